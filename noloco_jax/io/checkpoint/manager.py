"""The checkpointer: one run's checkpoints in `workdir/checkpoints`, saved by saving.py, restored by restoring.py.

Both share one orbax CheckpointManager (a restore that sets a step aside reloads the list the saves
keep from). What is saved is in saving.py; what restore does, and where a run starts, is in the
package docstring (io/checkpoint/__init__.py).
"""

from __future__ import annotations

import logging as py_logging
import os

import orbax.checkpoint as ocp

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import failures
from noloco_jax.io.checkpoint import restoring
from noloco_jax.io.checkpoint import saving
from noloco_jax.io.checkpoint.run_info import RunInfo

_QUIET_ORBAX = failures.QuietOrbaxLog()  # orbax's INFO lines dropped, its errors cut to one line


class Checkpointer:
  """Saves and restores one run's checkpoints in `workdir/checkpoints`. All processes call every method."""

  def __init__(self, run: RunInfo, workdir: str):
    """`run`: what the checkpointer knows of the run (run_info.py), made by set-up (training/run.py)."""
    workdir = os.path.abspath(workdir)
    self.directory = os.path.join(workdir, restoring.CHECKPOINT_DIR)
    ck = run.checkpoint
    py_logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # a no-op when already added
    py_logging.getLogger("asyncio").addFilter(_QUIET_ORBAX)  # orbax's abandoned write fragments
    failures.quiet_orbax_noise()  # the closed-event-loop tracebacks of a failed read (runtime/failures.py)
    manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep, enable_async_checkpointing=ck.async_save, create=True,
        cleanup_tmp_directories=True,  # leftovers of an interrupted write are never restored
        todelete_subdir=saving.DELETING))  # a rotated-out step leaves by one rename (saving.DELETING)
    saving.purge_deleted(self.directory)
    self._saver = saving.Saver(run, manager, self.directory)
    self._restorer = restoring.Restorer(run, manager, workdir, self.directory)

  def restore(self, state: TrainState, data_iter, loop_state):
    """(state, loop state) to start from: restoring.Restorer.restore."""
    return self._restorer.restore(state, data_iter, loop_state)

  def due(self, step: int) -> bool:
    """Whether the loop saves after `step` (checkpoint_every, the last step)."""
    return self._saver.due(step)

  def save(self, step: int, state: TrainState, loop_state, data_iter) -> None:
    """Starts saving the run after `step`: saving.Saver.save."""
    self._saver.save(step, state, loop_state, data_iter)

  def wait_until_finished(self) -> None:
    """Blocks until every save started so far is complete on disk."""
    self._saver.wait_until_finished()

  def close(self) -> None:
    """Waits for the last asynchronous save to be complete; a second call does nothing."""
    self._saver.close()

  def settle_after_error(self, timeout_s: float | None = None) -> None:
    """After the loop raised: completes the save in flight, or abandons it saying so (saving.py)."""
    self._saver.settle_after_error(timeout_s)
