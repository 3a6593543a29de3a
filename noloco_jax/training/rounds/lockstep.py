"""Lock-step rounds: every H inner steps, one outer round on every replica.

The round's programs come from outer/programs.RoundPrograms (where="merge"): for a method given in parts a
message and a merge program compiled once, and the round's routes (its grouping's ppermutes), compiled on
a background thread during round r's inner steps, so that no compile sits at the round boundary: the
boundary waits only if the compile took longer than the H inner steps (`compile_stats` records it).
Nothing is compiled for a round after the run's last step.
"""

from __future__ import annotations

from noloco_jax.outer import programs as programs_lib
from noloco_jax.training.rounds.base import RoundDriver


def last_round(next_round: int, step: int, last_step: int, inner_steps: int) -> int:
  """The index of the run's last round: rounds fall on the multiples of H in (step, last_step], the
  first of them being round `next_round` (one less than it: no round is left)."""
  return next_round + last_step // inner_steps - step // inner_steps - 1


class LockstepRounds(RoundDriver):

  def __init__(self, programs: programs_lib.RoundPrograms, inner_steps: int, traffic, last_step: int):
    """`traffic`: the bytes of one round (outer/wire.Traffic), counted in the loop state; `last_step`:
    the run's last step."""
    self._programs, self._H, self._traffic, self._last_step = programs, inner_steps, traffic, last_step
    self._started = False

  def start(self, run) -> None:
    super().start(run)
    last = last_round(run.loop.round, run.loop.step, self._last_step, self._H)
    if last < run.loop.round:  # no round left to run: compile nothing
      return
    self._programs.start(run.state, last_round=last, first_round=run.loop.round)
    self._started = True

  @property
  def compile_stats(self):
    return self._programs.stats if self._started else None

  def due(self, step: int) -> bool:
    return step % self._H == 0

  def after_step(self, run, step: int, metrics: dict) -> None:
    if not self.due(step):
      return
    compiled, route = self._programs.program(run.loop.round)  # also starts compiling the next round's
    run.state, round_metrics = programs_lib.lockstep_round(compiled)(run.state, route)
    run.loop.add_round(step, round_metrics, self._traffic)

  def close(self, failed: bool) -> None:
    if self._started:
      self._programs.close()
