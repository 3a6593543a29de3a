"""Lock-step rounds: every H inner steps, one compiled round program on every replica.

Round r's program (its grouping's ppermutes, outer/rounds.py) is compiled on a background thread
during round r's inner steps (outer/ahead.py), so that no compile sits at the round boundary: the
boundary waits only if the compile took longer than the H inner steps (`compile_stats` records it).
"""

from __future__ import annotations

from noloco_jax.training.rounds.base import RoundDriver


class LockstepRounds(RoundDriver):

  def __init__(self, rounds, inner_steps: int, traffic):
    """`traffic`: the bytes of one round (outer/wire.Traffic), counted in the loop state."""
    self._rounds, self._H, self._traffic = rounds, inner_steps, traffic
    self._programs = None

  def start(self, run) -> None:
    self._programs = self._rounds.ahead(run.state)
    self._programs.prefetch(run.loop.round)

  @property
  def compile_stats(self):
    return self._programs.compiler.stats if self._programs is not None else None

  def due(self, step: int) -> bool:
    return step % self._H == 0

  def after_step(self, run, step: int, metrics: dict) -> None:
    if not self.due(step):
      return
    round_fn, route = self._programs.program(run.loop.round)  # also starts compiling the next round's
    run.state, round_metrics = round_fn(run.state, route)
    run.loop.add_round(step, round_metrics, self._traffic)

  def close(self, failed: bool) -> None:
    if self._programs is not None:
      self._programs.close()
