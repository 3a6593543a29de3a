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


class Checkpointer(saving.Saver):
  """Saves and restores one run's checkpoints in `workdir/checkpoints`. All processes call every method.
  Saving (`due`, `save`, `wait_until_finished`, `close`, `settle_after_error`) is saving.Saver's; `restore`,
  restoring.Restorer's."""

  def __init__(self, run: RunInfo, workdir: str):
    """`run`: what the checkpointer knows of the run (run_info.py), made by set-up (training/run.py)."""
    workdir = os.path.abspath(workdir)
    directory = os.path.join(workdir, restoring.CHECKPOINT_DIR)
    ck = run.checkpoint
    py_logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # a no-op when already added
    py_logging.getLogger("asyncio").addFilter(_QUIET_ORBAX)  # orbax's abandoned write fragments
    failures.quiet_orbax_noise()  # the closed-event-loop tracebacks of a failed read (runtime/failures.py)
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep, enable_async_checkpointing=ck.async_save, create=True,
        cleanup_tmp_directories=True,  # leftovers of an interrupted write are never restored
        todelete_subdir=saving.DELETING))  # a rotated-out step leaves by one rename (saving.DELETING)
    saving.purge_deleted(directory)
    super().__init__(run, manager, directory)
    self._restorer = restoring.Restorer(run, manager, workdir, directory)

  def restore(self, state: TrainState, data_iter, loop_state):
    """(state, loop state) to start from: restoring.Restorer.restore."""
    return self._restorer.restore(state, data_iter, loop_state)
