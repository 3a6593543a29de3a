"""The training loop: a fixed sequence of named phases, naming no optional feature.

    set-up    the run opened: data, state (restored or fresh), writer (training/run.py)
    for every step:
      inner step       every replica, one jitted Optax update (training/build.py)
      round boundary   whatever the schedule does at it (training/rounds/: none, lock-step, overlapped)
      record           the plug-ins' per-step work, with no job-wide collective (training/plugins/)
      barrier work     at the steps some plug-in asks for: the driver settles, then evaluation, job-wide
                       logs, the stop agreement, checkpoints
    finish    plug-ins end, the summary (training/summary.py)

`train_and_evaluate(config, workdir)` is what main.py, the tests and the notebooks call.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from noloco_jax.runtime import workdir_lock
from noloco_jax.training import build as build_lib
from noloco_jax.training import plugins as plugins_lib
from noloco_jax.training import rounds as rounds_lib
from noloco_jax.training import run as run_lib
from noloco_jax.training import summary as summary_lib


def train_and_evaluate(config, workdir: str, process=None) -> dict[str, Any]:
  """Trains `config.num_replicas` replicas for `config.num_steps` steps; returns the final metrics.

  `config`: the typed config (config.load), or a ConfigDict, parsed here. One run per workdir: the
  workdir is locked for the whole run (runtime/workdir_lock.py). `process`: this run is one process of
  an asynchronous job (asynchronous/job.Process; `config` and `workdir` are then the process's own).
  """
  start_time = time.time()
  setup = build_lib.build(config)
  setup.process = process
  os.makedirs(workdir, exist_ok=True)
  with workdir_lock.hold(workdir), contextlib.ExitStack() as cleanup:
    run = run_lib.open_run(setup, workdir, cleanup)
    run.driver = driver = rounds_lib.make_driver(setup, run)
    run_lib.on_exit(cleanup, driver.close)
    run.plugins = plugins_lib.from_config(run)
    driver.start(run)
    run.plugins.start(run)
    _train(run, driver, run.plugins)
    driver.close(failed=False)  # nothing left in flight: the last step merged it
    run.plugins.end(run)
    if run.stop:
      return {"preempted": True, "step": run.loop.step, "state": run.state, "history": run.loop.history}
    return summary_lib.report(run, time.time() - start_time)


def _train(run: run_lib.Run, driver: rounds_lib.RoundDriver, plugins: plugins_lib.Plugins) -> None:
  for step in range(run.loop.step + 1, run.config.num_steps + 1):
    driver.before_step(run, step)
    run.state, metrics = run.setup.inner_step(run.state, run.next_batch())  # inner step
    run.loop.add_step(step, metrics, run.traffic_per_step)
    driver.after_step(run, step, metrics)  # round boundary
    plugins.after_step(run, step, metrics)  # record
    if plugins.barrier_due(run, step):  # barrier work
      driver.settle(run)  # no exchange in flight beside a job-wide collective
      plugins.at_barrier(run, step)
    if run.stop:
      break
