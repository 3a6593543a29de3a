"""The stop agreement: SIGTERM (preemption) stops the run after the current step, on every process.

runtime/preemption.py sets a flag on SIGTERM. One process acts on it after any step; several must
agree on the step (a process that leaves early would leave its partners waiting in their next
exchange), so they compare flags every `every` steps, at a barrier. The checkpointing plug-in then
saves, and the loop leaves.
"""

from __future__ import annotations

import jax

from noloco_jax.runtime import preemption
from noloco_jax.training.plugins.base import Plugin


class StopAgreement(Plugin):
  name = "stop"

  def __init__(self, every: int):
    self._every = max(every, 1)
    self._single = jax.process_count() == 1

  def after_step(self, run, step: int, metrics: dict) -> None:
    if self._single or step % self._every:
      # One process: its own flag. Several, between agreements: no collective, but a Ctrl-C that XLA's
      # callbacks swallowed is raised again here (runtime/preemption.py).
      run.stop = preemption.stop_requested(step, self._every)

  def barrier_due(self, run, step: int) -> bool:
    return not self._single and step % self._every == 0

  def at_barrier(self, run, step: int) -> None:
    if not self._single and step % self._every == 0:
      run.stop = preemption.stop_requested(step, self._every)  # an all-gather of every process's flag
