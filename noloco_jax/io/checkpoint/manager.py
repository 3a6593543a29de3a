"""The checkpointer: saves and restores one run's checkpoints in `workdir/checkpoints` (orbax).

A checkpoint is a step directory `workdir/checkpoints/<step>/` of three items: `state/` (the whole
replica-stacked TrainState, saved sharded: each process writes the shards of its own replicas),
`meta/` (records.py) and `data/` (data_item.py). What restore does, and where a run starts, is in
the package docstring (io/checkpoint/__init__.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging as py_logging
import os
import threading
import time
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import failures
from noloco_jax.runtime import preemption
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import guard
from noloco_jax.io.checkpoint import log_repair
from noloco_jax.io.checkpoint import logs
from noloco_jax.io.checkpoint import quarantine
from noloco_jax.io.checkpoint import records
from noloco_jax.io.checkpoint import resize
from noloco_jax.io.checkpoint.data_item import PerProcessJsonRestore, PerProcessJsonSave, merge_data_states

CHECKPOINT_DIR = "checkpoints"
SETTLE_TIMEOUT_S = 60  # multi-process jobs: how long a failed run waits for its save in flight


class IncompatibleCheckpointError(failures.ReportedError, ValueError):
  """The checkpoint is readable but was saved by a different setup: never a reason to fall back."""


class CheckpointSaveError(failures.ReportedError, OSError):
  """Writing a checkpoint failed (disk full, permissions, ...); the previous checkpoint is intact."""


class NoReadableCheckpointError(failures.ReportedError, RuntimeError):
  """The workdir holds checkpoints, none of which can be read."""


def _everywhere(ok: bool) -> bool:
  """True only if `ok` on every process (one all-gather of a flag in multi-process jobs)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


_QUIET_ORBAX = failures.QuietOrbaxLog()  # orbax's INFO lines dropped, its errors cut to one line


class Checkpointer:
  """Saves and restores one run's checkpoints in `workdir/checkpoints`. All processes call every method."""

  def __init__(self, setup, workdir: str):
    self._setup, self._config = setup, setup.config
    self._workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self._workdir, CHECKPOINT_DIR)
    ck = self._config.checkpoint
    py_logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # a no-op when already added
    py_logging.getLogger("asyncio").addFilter(_QUIET_ORBAX)  # orbax's abandoned write fragments
    failures.quiet_orbax_noise()  # the closed-event-loop tracebacks of a failed read (runtime/failures.py)
    self._in_flight: int | None = None  # the step of an asynchronous save not yet known complete
    self._closed = False
    self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep, enable_async_checkpointing=ck.async_save, create=True,
        cleanup_tmp_directories=True))  # leftovers of an interrupted write are never restored

  def due(self, step: int) -> bool:
    every = self._config.checkpoint_every
    return step == self._config.num_steps or (every > 0 and step % every == 0)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  # ---- save ----

  def save(self, step: int, state: TrainState, loop_state, data_iter) -> None:
    """Starts saving the run after `step` (asynchronously if configured); returns once it is safe to
    keep training (the device arrays have been copied).

    `loop_state` is the loop's record (training/loop_state.py): its `to_record()` is saved whole, in
    the meta item. With nan_policy="error", the losses it holds that were not yet logged are checked
    first: a state whose losses were not checked is never saved.

    A SIGINT (Ctrl-C) that arrives meanwhile is raised once the save has started (or, synchronous,
    completed), never inside orbax's code (runtime/preemption.py); the loop then settles it.
    """
    with preemption.deferred_interrupts():
      self._save(step, state, loop_state, data_iter)

  def _save(self, step: int, state: TrainState, loop_state, data_iter) -> None:
    record = loop_state.to_record()
    if record["step"] != step:
      raise ValueError(f"checkpoint: saving step {step} with a loop state at step {record['step']}.")
    if self._config.nan_policy == "error":
      guard.check_finite(records.pending_losses(record["pending"]), record["pending"]["steps"])
    bad = guard.nonfinite_replicas(state, self._setup.mesh)
    if bad:
      self.wait_until_finished()
      raise guard.NonFiniteStateError(
          f"the state after step {step} holds NaN or Inf on replica(s) {bad}; it was not saved. First change "
          "what diverged (e.g. a lower inner.lr or outer.rule.outer_lr).")
    meta = checksum.with_digest({  # the digest covers every field: an edit sets the step aside (checksum.py)
        "format": records.FORMAT, **record,
        "num_replicas": self._config.num_replicas, "process_count": jax.process_count(),
        "pairing": records.schedule_record(self._setup.schedule, record["round"]),
        "state_shapes": records.shapes(state), "config": self._config.to_dict(),
        "method": self._setup.method.kind,
        # Verified on restore: a data file changed after the save is caught, not trained on.
        "state_checksums": checksum.state_checksums(state, self._setup.mesh),
    })
    data = checksum.with_digest({"step": int(step), "process_index": jax.process_index(),
                                 "process_count": jax.process_count(), "iterator": data_iter.get_state()})
    start = time.time()
    # The previous (asynchronous) save is waited for here, not inside orbax's save: an error is then
    # blamed on the save that made it. orbax's save would wait too and raise either save's error alike.
    self.wait_until_finished()
    with self._save_errors(step):
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta), data=PerProcessJsonSave(data)))
    self._in_flight = step if self._config.checkpoint.async_save else None
    logging.info("checkpoint: step %d %s in %.2f s -> %s", step,
                 "started (async)" if self._config.checkpoint.async_save else "saved",
                 time.time() - start, self.directory)

  @contextlib.contextmanager
  def _save_errors(self, failed: int):
    """Turns a failed write of step `failed` into one clear error."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      self._in_flight = None
      raise CheckpointSaveError(
          f"writing checkpoint step {failed} to {self.directory} failed: {failures.first_line(e)}. "
          f"{self._intact(failed)}; fix the cause (e.g. free disk space) and run the same command to "
          f"{'resume' if self._intact_step(failed) is not None else 'start again'}.") from None

  def _intact_step(self, failed: int) -> int | None:
    # Read from disk: orbax's own list drops the steps a save will delete (checkpoint.keep) as the
    # save starts, but deletes them only once it has completed; a failed save deleted nothing.
    with contextlib.suppress(Exception):  # never hides the error being reported
      self._manager.reload()
    steps = [s for s in self._manager.all_steps() if s != failed]
    return max(steps) if steps else None

  def _intact(self, failed: int) -> str:
    step = self._intact_step(failed)
    return "No earlier checkpoint exists" if step is None else f"The previous checkpoint (step {step}) is intact"

  def wait_until_finished(self) -> None:
    """Blocks until every save started so far is complete on disk."""
    if self._in_flight is None:  # nothing in flight (or a synchronous save, whose errors were raised)
      return
    with self._save_errors(self._in_flight):
      self._manager.wait_until_finished()
    self._in_flight = None

  def close(self) -> None:
    """Waits for the last asynchronous save to be complete (a SIGINT meanwhile is raised after it); a
    second call does nothing."""
    if self._closed:
      return
    with preemption.deferred_interrupts():
      self.wait_until_finished()
      self._manager.close()
    self._closed = True

  def settle_after_error(self, timeout_s: float | None = None) -> None:
    """After the loop raised: completes the save in flight, or abandons it saying so; never raises.

    Without this, the exception unwinds to interpreter exit while orbax's background thread is still
    writing, and the step is left as a temporary directory (a rerun goes back one checkpoint further).
    Single-process jobs wait for it (`timeout_s=None`). In a multi-process job the write's commit
    waits for the other processes, which may be the ones that failed: a bounded wait.
    """
    step, self._in_flight = self._in_flight, None
    if step is None:
      return
    if timeout_s is None and jax.process_count() > 1:
      timeout_s = SETTLE_TIMEOUT_S
    errors: list[BaseException] = []

    def wait():
      try:
        self._manager.wait_until_finished()
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)

    waiter = threading.Thread(target=wait, name="noloco-checkpoint-settle", daemon=True)
    # Ctrl-C while waiting is counted, not raised (runtime/preemption.py): the first one may be why the
    # run is failing; one more abandons the wait.
    interrupts, again = preemption.interrupted(), False
    with preemption.deferred_interrupts():
      waiter.start()
      end = None if timeout_s is None else time.monotonic() + timeout_s
      while waiter.is_alive() and (end is None or time.monotonic() < end):
        waiter.join(0.1)
        if preemption.interrupted() > interrupts:
          again = True
          break
    if waiter.is_alive() or errors:
      why = (f"failed ({failures.first_line(errors[0])})" if errors else
             "was interrupted again (Ctrl-C); the next run removes its temporary directory" if again else
             f"did not complete within {timeout_s} s")
      logging.warning("checkpoint: the save of step %d, in flight when the run failed, %s and is abandoned. "
                      "%s.", step, why, self._intact(step))
      return
    logging.warning("checkpoint: the save of step %d, in flight when the run failed, was completed: "
                    "rerunning the same command resumes from it.", step)
    with contextlib.suppress(Exception):
      self._manager.close()

  # ---- restore ----

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
        state = resize.place(resize.resize_state(state, plan, self._setup.method.new_replica),
                             self._setup.state_shardings)
        record = resize.resize_loop_record(record, plan)
      if plan is None or plan.keeps_data:
        data_iter.set_state(merge_data_states(data))
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
    if self._config.checkpoint.warm_start:
      return self._warm_start(state, abstract), loop_state
    return state, loop_state

  def _read(self, step: int, abstract) -> tuple[dict | None, resize.Plan | None, Any, dict | None, Exception | None]:
    """(meta, elastic plan, state, per-process data files, None), or (..., the error) when a file of
    the step is unreadable. With a plan, the state is the checkpoint's, in host memory (resize.py)."""
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      data = self._manager.restore(step, args=ocp.args.Composite(data=PerProcessJsonRestore()))["data"]
      # Everything the resume reads is what was saved: the meta record and each process's data file
      # (their digests, checksum.py); the state is checked against the meta's checksums below.
      old_format = isinstance(meta, dict) and meta.get("format") == records.FORMAT_WITHOUT_DIGESTS
      checksum.verify_items(meta, data, step, digests_required=not old_format)
      if meta.get("format") not in (records.FORMAT, records.FORMAT_WITHOUT_DIGESTS) or meta.get("step") != step:
        raise ValueError(f"meta item: format {meta.get('format')!r}, step {meta.get('step')!r}")
    except Exception as e:  # pylint: disable=broad-except
      return None, None, None, None, e
    # Outside the try: a different setup, or an elastic setting that does not fit, is an error; a meta
    # record that contradicts itself (ItemChecksumError) is a damaged step, set aside like the others.
    try:
      plan = self._elastic_plan(meta, data, step)
      self._check_compatible(meta, abstract, step, plan)
    except checksum.ItemChecksumError as e:
      return None, None, None, None, e
    try:
      if plan is None:
        state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        checksum.verify(meta, state, self._setup.mesh)
      else:  # the checkpoint's replicas, read whole into host memory and resized there
        state = resize.read_host_state(self.directory, step, abstract, meta)
      return meta, plan, state, data, None
    except Exception as e:  # pylint: disable=broad-except
      return meta, plan, None, None, e

  def _expected_logs(self, meta: dict, step: int, plan) -> log_repair.Expected:
    """What the logs hold up to `step`, from the checkpoint (its config: how the run logged then)."""
    saved = meta.get("config") or {}
    schedule = self._setup.schedule if plan is None else None  # a resize changes the schedule
    return log_repair.Expected(
        step=step, evals=list(meta["history"].get("eval", [])),
        log_every=int(saved.get("log_every", self._config.log_every)), num_replicas=int(meta["num_replicas"]),
        rounds=int(meta["round"]) if self._setup.schedule is not None else 0,
        inner_steps=int((saved.get("outer") or {}).get("inner_steps", self._config.outer.inner_steps)),
        pairing_row=None if schedule is None else functools.partial(records.pairing_row, schedule),
        num_params=self._setup.model.num_params())

  def _elastic_plan(self, meta: dict, data: dict, step: int):
    """The resize.Plan for resuming this checkpoint, None for a plain resume (config.checkpoint.elastic)."""
    config, where = self._config, f"checkpoint step {step} in {self.directory}"
    try:
      mode = resize.mode_for(meta, config.num_replicas, config.checkpoint)
      plan = None if mode is None else resize.make_plan(
          mode=mode, elastic_replicas=config.checkpoint.elastic_replicas, old_n=int(meta["num_replicas"]),
          new_n=config.num_replicas, held=resize.held_by_process(data), process_count=jax.process_count(),
          seed=config.seed, step=step, rounds_done=int(meta["round"]), schedule=self._setup.schedule)
    except resize.ResizeError as e:
      raise IncompatibleCheckpointError(f"{where}: {str(e).rstrip('.')}.") from None
    if plan is None and config.checkpoint.elastic:
      logging.info("checkpoint: config.checkpoint.elastic=%s changes nothing in step %d (same replica count, no "
                   "replica to re-create, or already applied): resumed as saved.", config.checkpoint.elastic, step)
    return plan

  def _log_resize(self, plan, step: int, round_: int) -> None:
    """Says what changed: a log line, and (process 0) one row in elastic.jsonl, pairings.jsonl and metrics.jsonl."""
    logging.warning("%s", plan.describe())
    logging.warning("%s", resize.data_note(plan, step, self._config.data.batch_size))
    if jax.process_index() != 0:
      return
    event = plan.event(step, round_)
    for name in ("elastic.jsonl", "pairings.jsonl"):
      logs.replace_row(os.path.join(self._workdir, name), event)
    logs.replace_row(os.path.join(self._workdir, "metrics.jsonl"), {
        "step": int(step), "elastic/replicas_before": plan.old_n, "elastic/replicas_after": plan.new_n,
        "elastic/dropped": len(plan.dropped), "elastic/recreated": len(plan.recreated), "elastic/added": len(plan.added)})

  def _check_compatible(self, meta: dict, abstract, step: int, plan: resize.Plan | None = None) -> None:
    where = f"checkpoint step {step} in {self.directory}"
    changed = records.config_changes(meta.get("config", {}), self._config.to_dict())
    fields = f"config fields that differ: {_listed(changed)}" if changed else "no config field differs"
    remedy = ("Resume with the checkpoint's values (WORKDIR/config.json), use a new workdir, or start from its "
              "weights with config.checkpoint.warm_start.")
    saved_method = records.saved_method(meta)
    if saved_method != self._setup.method.kind:  # another method's state means something else, even where its shapes agree
      raise IncompatibleCheckpointError(f"{where} was saved by another outer method ({saved_method!r}, now "
                                        f"{self._setup.method.kind!r}); {fields}. {remedy}")
    saved, now = meta["state_shapes"], records.shapes(abstract)
    if plan is not None and plan.old_n != plan.new_n:  # another replica count, by request: the rest must match
      changed = [c for c in changed if not c.startswith("num_replicas:")]
      fields = f"config fields that differ: {_listed(changed)}" if changed else "no other config field differs"
      why = resize.other_differences(saved, now, meta["pairing"],
                                     records.schedule_record(self._setup.schedule, meta["round"]))
      if why:
        raise IncompatibleCheckpointError(f"{where} {why}; {fields}. {remedy}")
      if changed:
        logging.warning("resume: the config differs from the checkpoint's in %s.", changed)
      return
    if saved != now:
      diff = [f"{k}: saved {saved.get(k)}, now {now.get(k)}" for k in sorted(set(saved) | set(now))
              if saved.get(k) != now.get(k)]
      raise IncompatibleCheckpointError(
          f"{where} holds a state of another shape (num_replicas, model, optimizer or outer method "
          f"changed); {fields}; state leaves: {diff[:3]}{' ...' if len(diff) > 3 else ''}. {remedy}")
    expected = records.schedule_record(self._setup.schedule, meta["round"])
    if meta["pairing"] != expected:
      # Another schedule only if the config says so; else the record is damaged (not a reason to refuse).
      differs = records.schedule_differences(meta["pairing"], expected)
      if not changed or records.same_schedule_parameters(meta["pairing"], expected):
        # The record contradicts the config saved beside it: with no config field changed, this config's
        # schedule is the one the checkpoint was saved under; and the same schedule (seed, mode, group
        # size, replicas: the schedule's own record) cannot give another grouping. A damaged record,
        # not another setup: set aside like any unreadable step.
        raise checksum.ItemChecksumError(
            f"meta/metadata: its pairing record disagrees with the schedule of its own config "
            f"({differs}): the record is damaged")
      raise IncompatibleCheckpointError(
          f"{where} was saved under another pairing schedule ({differs}); {fields}. Resume with the "
          "checkpoint's config (WORKDIR/config.json), or use a new workdir.")
    if changed:
      logging.warning("resume: the config differs from the checkpoint's in %s; the resumed run is exact "
                      "only for changes of layout (num_devices) or checkpointing.", changed)

  def _warm_start(self, state: TrainState, abstract) -> TrainState:
    """θ of every replica from another run's checkpoint; everything else fresh (see module docstring)."""
    root, step = _resolve_warm_start(self._config.checkpoint.warm_start)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = {k: v for k, v in meta["state_shapes"].items() if k.startswith(".params")}
    now = {k: v for k, v in records.shapes(abstract).items() if k.startswith(".params")}
    if saved != now:
      raise IncompatibleCheckpointError(
          f"config.checkpoint.warm_start={self._config.checkpoint.warm_start!r}: its weights (step {step}) "
          "do not fit this run's replicas and model: "
          f"{[k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)][:5]}.")
    target = {"params": abstract.params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
    params = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)))["state"]["params"]
    manager.close()
    sharding = jax.tree.map(lambda x: x.sharding, abstract.outer)
    outer = jax.jit(jax.vmap(self._setup.method.init), out_shardings=sharding)(params)
    logging.info("checkpoint: warm start from the weights of step %d in %s.", step, root)
    return state.replace(params=params, outer=outer)


def _listed(changes: list[str], shown: int = 6) -> str:
  return "; ".join(changes[:shown]) + (f"; and {len(changes) - shown} more" if len(changes) > shown else "")


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
