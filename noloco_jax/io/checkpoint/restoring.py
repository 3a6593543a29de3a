"""Restoring a run: its latest readable checkpoint, else a warm start, else the fresh state.

What a resume reads is verified first (checksum.py) and checked against this run (compatibility.py); an
unreadable step is quarantined (quarantine.py) and the previous one taken. The order of the sources
is in the package docstring (io/checkpoint/__init__.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import failures
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import compatibility
from noloco_jax.io.checkpoint import data_item
from noloco_jax.io.checkpoint import log_repair
from noloco_jax.io.checkpoint import logs
from noloco_jax.io.checkpoint import quarantine
from noloco_jax.io.checkpoint import records
from noloco_jax.io.checkpoint import resize
from noloco_jax.io.checkpoint.run_info import RunInfo

CHECKPOINT_DIR = "checkpoints"  # a run's checkpoints: WORKDIR/checkpoints/<step>/


class NoReadableCheckpointError(failures.ReportedError, RuntimeError):
  """The workdir holds checkpoints, none of which can be read."""


def _everywhere(ok: bool) -> bool:
  """True only if `ok` on every process (one all-gather of a flag in multi-process jobs)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


class Restorer:
  """Restores one run from `manager` (orbax) over `workdir/checkpoints`. All processes call `restore`."""

  def __init__(self, run: RunInfo, manager: ocp.CheckpointManager, workdir: str, directory: str):
    self._run = run
    self._manager, self._workdir, self.directory = manager, workdir, directory

  def restore(self, state: TrainState, data_iter, loop_state):
    """(state, loop state) to start from: own checkpoint, else warm start, else the fresh arguments.

    `loop_state` is the loop's fresh record; when resuming, the saved one is returned instead, of
    the same type (`type(loop_state).from_record`). Positions `data_iter` and rewrites the logs
    when resuming.

    Consumes `state`: when the workdir holds checkpoints its buffers are freed before reading, so
    that a model that fits in memory once is never held twice. `state` may also be abstract
    (`jax.eval_shape(setup.init_state)`) when the caller knows it will not be needed.
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    steps = sorted(self._manager.all_steps(), reverse=True)
    if steps:
      jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state)
    bad = []
    for saved in steps:
      meta, plan, state, data, error = self._read(saved, abstract)
      if not _everywhere(error is None):
        logging.warning("checkpoint: step %d in %s is not readable (%s: %s); trying the previous one.",
                        saved, self.directory, type(error).__name__, str(error)[:300])
        bad.append(saved)
        continue
      if bad:
        quarantine.quarantine(self._workdir, self.directory, bad)
        self._manager.reload()
      record = records.loop_record(meta)
      if plan is not None:  # config.checkpoint.elastic: another set of replicas (resize.py)
        # A new replica of "grow" is made from its peer by the method, which owns its state.
        state = resize.place(resize.resize_state(state, plan, self._run.method.new_replica),
                             self._run.state_shardings)
        record = resize.resize_loop_record(record, plan)
      if plan is None or plan.keeps_data:
        data_iter.set_state(data_item.merge_data_states(data))
      logs.truncate_logs(self._workdir, saved)
      log_repair.repair(self._workdir, self._expected_logs(meta, saved, plan))  # rows missing before the step
      if plan is not None:
        self._log_resize(plan, saved, meta["round"])
      logging.info("checkpoint: resumed from step %d (round %d) in %s.", saved, meta["round"], self.directory)
      return state, type(loop_state).from_record(record)
    if bad:
      raise NoReadableCheckpointError(
          f"no readable checkpoint in {self.directory} (steps {bad} all failed, see the warnings above); "
          "move the directory away to start this workdir from scratch.")
    logs.start_logs_afresh(self._workdir)  # a run killed before its first checkpoint completed left rows
    if self._run.checkpoint.warm_start:
      return self._warm_start(state, abstract), loop_state
    return state, loop_state

  def _read(self, step: int, abstract) -> tuple[dict | None, resize.Plan | None, Any, dict | None, Exception | None]:
    """(meta, elastic plan, state, per-process data files, None), or (..., the error) when a file of
    the step is unreadable. With a plan, the state is the checkpoint's, in host memory (resize.py)."""
    try:
      # Everything the resume reads is what was saved: the meta record and each process's data file
      # (their digests, checksum.py); the state is checked against the meta's checksums below.
      meta, data = data_item.restore_items(self._manager, step)
    except Exception as e:  # pylint: disable=broad-except
      return None, None, None, None, e
    # Outside the try: a different setup, or an elastic setting that does not fit, is an error; a meta
    # record that contradicts itself (ItemChecksumError) is a damaged step, set aside like the others.
    where = f"checkpoint step {step} in {self.directory}"
    try:
      plan = compatibility.elastic_plan(self._run, meta, data, step, where)
      compatibility.check(self._run, meta, abstract, where, plan)
    except checksum.ItemChecksumError as e:
      return None, None, None, None, e
    try:
      if plan is None:
        state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        checksum.verify(meta, state, self._run.mesh)
      else:  # the checkpoint's replicas, read whole into host memory and resized there
        state = resize.read_host_state(self.directory, step, abstract, meta)
      return meta, plan, state, data, None
    except Exception as e:  # pylint: disable=broad-except
      return meta, plan, None, None, e

  def _expected_logs(self, meta: dict, step: int, plan) -> log_repair.Expected:
    """What the logs hold up to `step`, from the checkpoint (its config: how the run logged then)."""
    saved, run = meta.get("config") or {}, self._run
    schedule = run.schedule if plan is None else None  # a resize changes the schedule
    return log_repair.Expected(
        step=step, evals=list(meta["history"].get("eval", [])),
        log_every=int(saved.get("log_every", run.log_every)), num_replicas=int(meta["num_replicas"]),
        rounds=int(meta["round"]) if run.schedule is not None else 0,
        inner_steps=int((saved.get("outer") or {}).get("inner_steps", run.inner_steps)),
        pairing_row=None if schedule is None else functools.partial(records.pairing_row, schedule),
        num_params=run.num_params)

  def _log_resize(self, plan, step: int, round_: int) -> None:
    """Says what changed: a log line, and (process 0) one row in elastic.jsonl, pairings.jsonl and metrics.jsonl."""
    logging.warning("%s", plan.describe())
    logging.warning("%s", resize.data_note(plan, step, self._run.batch_size))
    if jax.process_index() != 0:
      return
    event = plan.event(step, round_)
    for name in ("elastic.jsonl", "pairings.jsonl"):
      logs.replace_row(os.path.join(self._workdir, name), event)
    logs.replace_row(os.path.join(self._workdir, "metrics.jsonl"), {
        "step": int(step), "elastic/replicas_before": plan.old_n, "elastic/replicas_after": plan.new_n,
        "elastic/dropped": len(plan.dropped), "elastic/recreated": len(plan.recreated), "elastic/added": len(plan.added)})

  def _warm_start(self, state: TrainState, abstract) -> TrainState:
    """θ of every replica from another run's checkpoint; everything else fresh (see the package docstring)."""
    root, step = _resolve_warm_start(self._run.checkpoint.warm_start)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = {k: v for k, v in meta["state_shapes"].items() if k.startswith(".params")}
    now = {k: v for k, v in records.shapes(abstract).items() if k.startswith(".params")}
    if saved != now:
      raise compatibility.IncompatibleCheckpointError(
          f"config.checkpoint.warm_start={self._run.checkpoint.warm_start!r}: its weights (step {step}) "
          "do not fit this run's replicas and model: "
          f"{[k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)][:5]}.")
    target = {"params": abstract.params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
    params = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)))["state"]["params"]
    manager.close()
    sharding = jax.tree.map(lambda x: x.sharding, abstract.outer)
    outer = jax.jit(jax.vmap(self._run.method.init), out_shardings=sharding)(params)
    logging.info("checkpoint: warm start from the weights of step %d in %s.", step, root)
    return state.replace(params=params, outer=outer)


def _resolve_warm_start(path: str) -> tuple[str, int]:
  """(checkpoints root, step) for a workdir, a checkpoints directory or a step directory."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), int(os.path.basename(path))
  if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
    path = os.path.join(path, CHECKPOINT_DIR)
  steps = [int(n) for n in os.listdir(path) if n.isdigit()] if os.path.isdir(path) else []
  if not steps:
    raise FileNotFoundError(f"config.checkpoint.warm_start={path!r} holds no checkpoint (a workdir, its "
                            "checkpoints directory, or one step directory).")
  return path, max(steps)
