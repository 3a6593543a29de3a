"""Checkpoint saving: every `checkpoint_every` steps, at the last step, and when a stop was agreed.

A save is a job-wide barrier (every process writes its shards of one step). Every log row up to the
step is flushed to disk before the save starts (io/checkpoint/logs.py): a checkpoint never covers a
row that a crash could lose. With streaming overlap the round driver has settled first, so the state
saved holds the group mean in flight; the driver's own record goes into the loop state saved with it. (Restoring is part of the run's set-up: training/run.py.)
"""

from __future__ import annotations

import logging

from noloco_jax.training.plugins.base import Plugin


class Checkpointing(Plugin):
  name = "checkpoint"

  def barrier_due(self, run, step: int) -> bool:
    return run.checkpointer.due(step) or run.stop

  def at_barrier(self, run, step: int) -> None:
    if not (run.checkpointer.due(step) or run.stop):
      return
    run.flush_logs()
    if run.driver is not None:
      run.loop.driver = run.driver.save()
    # checks the pending losses and the state first; with overlap, the mean in flight is in the state
    run.checkpointer.save(step, run.state, run.loop, run.data)
    if run.stop:
      logging.warning("Stop requested: saved a checkpoint at step %d; run the same command to resume.", step)

  def end(self, run) -> None:
    run.checkpointer.close()  # the last (asynchronous) save is complete before the run reports
