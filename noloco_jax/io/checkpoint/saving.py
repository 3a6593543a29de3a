"""Saving a run's checkpoints: the NaN checks, the three items of a step, a failed or unfinished write.

A step is saved as `workdir/checkpoints/<step>/` with three items: `state/` (the replica-stacked
TrainState, sharded: each process writes the shards of its own replicas), `meta/` (records.py) and
`data/` (data_item.py). With `checkpoint.async_save` orbax writes them on a thread of its own while
training goes on; a failed write is one error naming the step, the cause and the intact previous step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

from absl import logging
import jax
import orbax.checkpoint as ocp

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import failures
from noloco_jax.runtime import preemption
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import guard
from noloco_jax.io.checkpoint import records
from noloco_jax.io.checkpoint.data_item import PerProcessJsonSave
from noloco_jax.io.checkpoint.run_info import RunInfo

SETTLE_TIMEOUT_S = 60  # multi-process jobs: how long a failed run waits for its save in flight
# Where orbax's rotation moves a step it removes (`todelete_subdir`): a rename is atomic, so a process
# killed mid-removal never leaves a half-deleted step that still reads as committed (orbax's own
# deletion removes the files one by one in place: bench_churn found one such step after a SIGKILL).
# Emptied here once each save is complete; not a step name, so no reader lists it.
DELETING = "deleting"


def purge_deleted(directory: str) -> None:
  """Removes the steps orbax's rotation moved into `directory/DELETING` (each entry, not the folder: a
  rename into it may be under way); a removal cut short is finished by the next call."""
  folder = os.path.join(directory, DELETING)
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


class CheckpointSaveError(failures.ReportedError, OSError):
  """Writing a checkpoint failed (disk full, permissions, ...); the previous checkpoint is intact."""


class Saver:
  """Saves one run's checkpoints through `manager` (orbax). All processes call every method."""

  def __init__(self, run: RunInfo, manager: ocp.CheckpointManager, directory: str):
    self._run = run
    self._manager, self.directory = manager, directory
    self._in_flight: int | None = None  # the step of an asynchronous save not yet known complete
    self._closed = False

  def due(self, step: int) -> bool:
    """Whether the loop saves after `step` (checkpoint_every, the last step)."""
    every = self._run.checkpoint_every
    return step == self._run.num_steps or (every > 0 and step % every == 0)

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
    run = self._run
    if run.nan_policy == "error":
      guard.check_finite(records.pending_losses(record["pending"]), record["pending"]["steps"])
    bad = guard.nonfinite_replicas(state, run.mesh)
    if bad:
      self.wait_until_finished()
      raise guard.NonFiniteStateError(
          f"the state after step {step} holds NaN or Inf on replica(s) {bad}; it was not saved. First change "
          "what diverged (e.g. a lower inner.lr or outer.rule.outer_lr).")
    # The digest covers every field: an edit sets the step aside (checksum.py). `with_digest` returns a
    # snapshot: orbax serialises the JSON items later, on its own thread, while the loop goes on adding
    # to the live objects of `record` (its history): what is written must be what was digested now.
    meta = checksum.with_digest({
        "format": records.FORMAT, **record,
        "num_replicas": run.num_replicas, "process_count": jax.process_count(),
        "pairing": records.schedule_record(run.schedule, record["round"]),
        "state_shapes": records.shapes(state), "config": run.config_record,
        "method": run.method.kind,
        # Verified on restore: a data file changed after the save is caught, not trained on.
        "state_checksums": checksum.state_checksums(state, run.mesh),
    })
    data = checksum.with_digest({"step": int(step), "process_index": jax.process_index(),
                                 "process_count": jax.process_count(), "iterator": data_iter.get_state()})
    start = time.time()
    # The previous (asynchronous) save is waited for here, not inside orbax's save: an error is then
    # blamed on the save that made it. orbax's save would wait too and raise either save's error alike.
    self.wait_until_finished()
    purge_deleted(self.directory)  # the steps the last save's rotation moved aside
    with self._save_errors(step):
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta), data=PerProcessJsonSave(data)))
    self._in_flight = step if run.checkpoint.async_save else None
    logging.info("checkpoint: step %d %s in %.2f s -> %s", step,
                 "started (async)" if run.checkpoint.async_save else "saved",
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
    purge_deleted(self.directory)
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
