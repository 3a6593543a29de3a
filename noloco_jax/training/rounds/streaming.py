"""Fragment streaming's rounds (`outer.streaming.fragments` = F > 1; outer/streaming.py): every H/F steps one
fragment's round, lock-step or overlapped.

At step t = b·H/F (boundary b) the round is fragment f = b mod F's (outer/streaming.boundary_fragment), its
j-th: the fragment's compiled programs (outer/programs.RoundPrograms over outer/streaming.fragment_method,
one set per fragment, each compiling its next round's exchange ahead) run as the lock-step driver runs a
round (τ = 0: message, routes, merge at once), or as the overlapped one does (τ > 0: message and exchange
at t, the merge after step t + τ, which the config keeps before the next fragment's send at t + H/F, so one
exchange at most is in flight). The loop counts every fragment's round as a round (`LoopState.round` = the
fragment rounds done, q), with that fragment's bytes.

Nothing but the step is needed to know where a run is: a resumed run derives each fragment's next round from
it, and an overlapped one's record is the step whose exchange is in flight (its fragment is that step's),
whose mean the checkpointed state holds in the fragment's part of the in-flight buffer (outer/base.INFLIGHT).
"""

from __future__ import annotations

import jax

from noloco_jax.outer import base
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import streaming
from noloco_jax.training.rounds import overlapped
from noloco_jax.training.rounds.base import InFlight, RoundDriver


class StreamingRounds(overlapped.OverlappedRounds):
  """The overlapped driver's bookkeeping (the exchange in flight, `save` / `restore`, when its merge is due) over
  one set of round programs per fragment, a round every H/F steps; τ = 0: nothing is ever in flight."""

  def __init__(self, method, fragments, mesh, pairing: streaming.Pairing, state_shardings, *, inner_steps: int,
               tau: int, mix: float, last_step: int, traffic, threaded: bool = False):
    """`fragments`: outer/streaming.cut's, each run as the round of streaming.fragment_method(method, it);
    `traffic`: each fragment's bytes of one round (outer/wire.Traffic); `state_shardings`: the state's home
    layout (None: every leaf split over `replica`, as tests build)."""
    self.F = len(fragments)
    self._every, self.tau, self._last, self._traffic = inner_steps // self.F, tau, last_step, traffic
    where = "exchange" if tau else "merge"
    self._programs = [programs_lib.RoundPrograms(streaming.fragment_method(method, fragment), mesh,
                                                 pairing.of_fragment(f), state_shardings, where=where,
                                                 mix=mix if tau else None) for f, fragment in enumerate(fragments)]
    self._stats = self._programs[0].stats
    for p in self._programs:  # one record of the compiles for the round trace, whatever the fragment
      p.stats = self._stats
    # Overlapped: the arrived mean goes into its fragment's part of the state's in-flight buffer (`settle`).
    self._hold = [jax.jit(streaming.hold(fragment, base.INFLIGHT), donate_argnums=0, out_shardings=state_shardings)
                  for fragment in fragments] if tau else None
    self._inflight = InFlight(threaded, "stream-exchange")
    self._started = False

  def start(self, run) -> None:
    RoundDriver.start(self, run)  # the record restored; the overlapped driver's one set of programs is not ours
    b0, b1 = run.loop.step // self._every, self._last // self._every
    for f, programs in enumerate(self._programs):
      # Every fragment's message and merge (a resumed run may have to merge an exchange in flight of a fragment
      # with no round left); no exchange for a round after the run's last step.
      first, last = streaming.rounds_done(f, b0, self.F), streaming.rounds_done(f, b1, self.F) - 1
      programs.start(run.state, last_round=last, first_round=first)
    self._started = True

  def after_step(self, run, step: int, metrics: dict) -> None:
    if step % self._every == 0:
      f, j = streaming.boundary_fragment(step // self._every, self.F)
      compiled, route = self._programs[f].program(j)  # also starts compiling this fragment's next round
      if not self.tau:
        run.state, round_metrics = programs_lib.lockstep_round(compiled)(run.state, route)
        run.loop.add_round(step, round_metrics, self._traffic[f])
      else:
        run.state, sent, round_metrics = compiled["message"](run.state)
        self._inflight.send(step, compiled["exchange"], *sent, route)
        run.loop.add_round(step, round_metrics, self._traffic[f], applied=False)
    if self._merge_due(step):
      f = self._fragment_in_flight()
      self.settle(run)
      (merge,) = self._programs[f].get("merge")
      run.state = merge(run.state)
      self._inflight.clear()
      run.loop.round_applied(step)

  def _fragment_in_flight(self) -> int:
    return streaming.boundary_fragment(self.sent_at // self._every, self.F)[0]

  def settle(self, run) -> None:
    """Waits for the exchange in flight (if any) and puts its mean into its fragment of the in-flight buffer."""
    if not self._inflight.pending:
      return
    mean = jax.block_until_ready(self._inflight.result())
    run.state = self._hold[self._fragment_in_flight()](run.state, mean)

  def close(self, failed: bool) -> None:
    self._inflight.close(failed)
    if self._started:
      for programs in self._programs:
        programs.close()
