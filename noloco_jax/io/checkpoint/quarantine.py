"""Unreadable checkpoint steps are moved to `workdir/checkpoints_corrupt/`, out of orbax's sight.

A step whose files are unreadable (truncated, partly deleted) fails to restore: the run warns, moves
it aside (so that later saves may reuse its number) and takes the previous step.
"""

from __future__ import annotations

import os
import shutil
import time

from absl import logging
import jax
from jax.experimental import multihost_utils

CORRUPT_DIR = "checkpoints_corrupt"


def quarantine(workdir: str, directory: str, steps: list[int]) -> None:
  """Moves the step directories `steps` of `directory` to workdir/checkpoints_corrupt/<step>-<time>.

  Process 0 moves them; every process then waits for it (the caller reloads its manager after).
  """
  if jax.process_index() == 0:
    target_root = os.path.join(workdir, CORRUPT_DIR)
    os.makedirs(target_root, exist_ok=True)
    for step in steps:
      target = os.path.join(target_root, f"{step}-{int(time.time())}")
      shutil.move(os.path.join(directory, str(step)), target)
      logging.warning("checkpoint: moved unreadable step %d to %s.", step, target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("noloco_jax.io.checkpoint.quarantine")
