"""A run in progress: what the loop, its round driver and its plug-ins share, and how it is opened.

`open_run(setup, workdir, cleanup)` is the loop's set-up phase, top to bottom: this process's data,
the state built sharded, the start-up consistency check of a multi-process job, then the state and the
loop record to start from (the latest checkpoint of the workdir, else a warm start, else fresh:
io/checkpoint; a resume also rewrites the logs), the run's config written beside its checkpoints,
and the metric writer. Every resource it opens registers its closer with `cleanup` as it opens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Callable

import jax

from noloco_jax.inner.state import TrainState
from noloco_jax.io import checkpoint as checkpoint_lib
from noloco_jax.io import data as data_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.outer import wire
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.runtime import distributed
from noloco_jax.training import build as build_lib
from noloco_jax.training.loop_state import LoopState
from noloco_jax.runtime import faults


class StepRate:
  """Steps/s and tokens/s since the last log, evaluation time left out (`restart` after it)."""

  def __init__(self, step: int, tokens_per_step: int):
    self._time, self._step, self._tokens_per_step = time.time(), step, tokens_per_step

  def since_last_log(self, step: int) -> dict[str, float]:
    now = time.time()
    steps_per_s = (step - self._step) / max(now - self._time, 1e-9)
    self._time, self._step = now, step
    return {"perf/steps_per_s": steps_per_s, "perf/tokens_per_s": steps_per_s * self._tokens_per_step}

  def restart(self, step: int | None = None) -> None:
    """From now (after an evaluation), or from `step` now (the loop jumped there: an asynchronous join)."""
    self._time = time.time()
    if step is not None:
      self._step = step


@dataclasses.dataclass
class Run:
  """The run in progress. The loop replaces `state` every step; the driver and plug-ins read it here."""
  setup: build_lib.Setup
  workdir: str
  state: TrainState
  loop: LoopState  # step, round, bytes, history, pending metrics: checkpointed whole
  data: Any  # this process's training iterator (its replicas' batches)
  eval_batches: jax.Array  # validation batches, replicated on the mesh
  writer: metrics_lib.writers.MetricWriter  # metrics.jsonl + TensorBoard (process 0), log lines
  checkpointer: checkpoint_lib.Checkpointer
  on_exit: Callable[[Callable[[bool], None]], None]  # registers closer(failed) with the clean-up
  start_step: int  # the step restored from this workdir's checkpoint (0: not resumed)
  traffic_per_round: wire.Traffic  # bytes of one round per replica, on the wire and as operands
  traffic_per_step: wire.Traffic  # ... and of one inner step (ddp)
  faults: faults.Injector | None = None  # NOLOCO_FAULTS / NOLOCO_TRACE (tests, benchmarks), else None
  rate: StepRate | None = None
  phase_seconds: dict = dataclasses.field(default_factory=dict)  # time at barriers, by plug-in
  plugins: Any = None  # training/plugins.Plugins: `flush_logs` reaches every log through it
  driver: Any = None  # training/rounds.RoundDriver: the round schedule (its logs, its counters, its record)
  stop: bool = False  # a stop was agreed (SIGTERM): save and leave the loop after this step

  @property
  def config(self):
    return self.setup.config

  def next_batch(self) -> jax.Array:
    """The next global [N, B, L+1] batch, assembled from this process's replicas' rows."""
    return sharding_lib.global_array(self.setup.mesh, next(self.data), self.config.num_replicas)

  def flush_logs(self) -> None:
    """Every log row written so far (every plug-in's, and the writer's) reaches its file and the disk."""
    if self.plugins is not None:
      self.plugins.flush(self)
    if self.driver is not None:
      self.driver.flush()
    self.writer.flush()


def on_exit(cleanup: contextlib.ExitStack, closer: Callable[[bool], None]) -> None:
  """Registers `closer(failed)` with `cleanup`: called on the way out, `failed` when an exception is
  unwinding. A closer's own error never hides the run's (it is logged)."""

  def exit_(exc_type, exc, tb) -> bool:
    del exc, tb
    try:
      closer(exc_type is not None)
    except Exception:  # pylint: disable=broad-except
      if exc_type is None:
        raise
      logging.exception("closing after an error failed")
    return False  # never swallows the exception

  cleanup.push(exit_)


def checkpoint_info(setup: build_lib.Setup) -> checkpoint_lib.RunInfo:
  """What the checkpointer is given of this run (io/checkpoint/run_info.py): its section of the config,
  the config's record as data (saved with every step, compared on resume), and plain values."""
  config = setup.config
  return checkpoint_lib.RunInfo(
      checkpoint=config.checkpoint, config_record=config.to_dict(), num_steps=config.num_steps,
      checkpoint_every=config.checkpoint_every, nan_policy=config.nan_policy, num_replicas=config.num_replicas,
      seed=config.seed, log_every=config.log_every, inner_steps=config.outer.inner_steps,
      batch_size=config.data.batch_size, num_params=setup.model.num_params(), mesh=setup.mesh,
      schedule=setup.schedule, state_shardings=setup.state_shardings, method=setup.method)


def open_run(setup: build_lib.Setup, workdir: str, cleanup: contextlib.ExitStack) -> Run:
  """The run's set-up phase (module docstring); every resource it opens closes with `cleanup`."""
  config, mesh, n = setup.config, setup.mesh, setup.config.num_replicas
  close = lambda closer: on_exit(cleanup, closer)
  local_ids = mesh_lib.local_replica_ids(mesh, n)  # each process reads only the replicas its devices hold
  data_ids, data_n = local_ids, n
  if setup.process is not None:  # a process of an asynchronous job: its replica's shard of the job's data
    data_ids, data_n = list(setup.process.replica_ids), setup.process.num_replicas
  data = data_lib.make_train_iterator(config.data, seed=config.seed, replica_ids=data_ids, num_replicas=data_n,
                                      vocab_size=setup.model.vocab_size)
  close(lambda failed: data.close())
  # The validation sample is drawn with a fixed seed, not config.seed, so that runs with different
  # seeds (e.g. compare_methods.py) are scored on the same sequences.
  eval_batches = jax.device_put(data_lib.make_eval_batches(config.data, seed=0, vocab_size=setup.model.vocab_size),
                                mesh_lib.replicated(mesh))
  where = (f"process {jax.process_index()} of {jax.process_count()}" if setup.process is None else
           f"process {setup.process.slot} of an asynchronous job of {setup.process.num_replicas}")
  logging.info("Global batch: %d replicas × %d sequences × %d tokens; %d devices (%d replicas each, %s); "
               "%s holds replicas %s.", n, config.data.batch_size, config.data.seq_len,
               mesh.devices.size, mesh_lib.replicas_per_device(mesh, n), setup.replica_map, where, data_ids)

  state = setup.init_state()
  # All processes agree on config/seed/layout, share the workdir, and every replica starts bit-identical
  # (before any restore).
  distributed.check_consistency(config.to_json(sort_keys=True), mesh, state, seed=config.seed, num_replicas=n,
                                batch=(config.data.batch_size, config.data.seq_len), workdir=workdir)
  checkpointer = checkpoint_lib.Checkpointer(checkpoint_info(setup), workdir)
  # A failed run completes (or, in a multi-process job, abandons after a bounded wait, saying so) the
  # save in flight: never lost silently. A finished run waits for its last save.
  close(lambda failed: checkpointer.settle_after_error() if failed else checkpointer.close())
  state, loop = checkpointer.restore(state, data, LoopState())  # latest checkpoint, warm start, or fresh
  if jax.process_index() == 0:  # only now: a refused resume leaves the config that describes the checkpoints
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))
  # Opened after the restore, which rewrites the logs for a resume (io/checkpoint/logs.py): a writer opened
  # before would append to the file the rewrite replaced.
  writer = metrics_lib.make_writer(workdir, config.wandb, config.to_dict())
  close(lambda failed: writer.close())
  one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  # Bytes per replica of one round and of one inner step: on the wire, under outer.rule.allreduce_algorithm,
  # and the collectives' operands (outer/wire.py).
  per_round, per_step = setup.method.traffic(one_replica, n)
  loop.fill_wire_bytes(per_round, per_step)  # a checkpoint from before the wire was counted
  run = Run(setup=setup, workdir=workdir, state=state, loop=loop, data=data, eval_batches=eval_batches,
            writer=writer, checkpointer=checkpointer, on_exit=close,
            start_step=loop.step, traffic_per_round=per_round, traffic_per_step=per_step,
            faults=faults.from_env(None if setup.process is None else setup.process.slot),
            rate=StepRate(loop.step, n * config.data.batch_size * config.data.seq_len))
  return run
