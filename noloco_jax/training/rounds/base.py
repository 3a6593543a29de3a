"""The round-driver interface: everything that happens at a round boundary, behind one object.

The training loop (training/loop.py) calls a driver at fixed points of every step and never asks what
kind of rounds a run has:

    driver.before_step(run, step)            # before the inner step (the skip-round guard's snapshot)
    driver.after_step(run, step, metrics)    # the round boundary, if `due(step)`: may replace run.state
    driver.settle(run)                       # before any job-wide collective (evaluation, a job-wide
                                             # log, the stop agreement, a checkpoint)

A driver owns the rule that no other collective starts while one of its exchanges is in flight
(two processes could then enter their collectives in different orders, which deadlocks): `settle`
is where it waits, and afterwards run.state holds everything a checkpoint must save. A driver records
each round in run.loop (`LoopState.add_round`, `round_applied`), so that logs and checkpoints see rounds
the same way whatever the schedule.

Implementations (training/rounds/__init__.py chooses one): `NoRounds` (ddp, none), `LockstepRounds`
(every H steps one compiled round, the next one's program compiled ahead), `OverlappedRounds` (the
exchange in flight for τ inner steps). Cross-cutting behaviour wraps any of them (wrappers.py): the
nan_policy="skip_round" guard and NOLOCO_TRACE's round timing. A new schedule is one more driver.
"""

from __future__ import annotations


class RoundDriver:
  """Base and `NoRounds`: a run without outer rounds (ddp, none) does nothing at any boundary."""

  # outer/ahead.Stats of the programs this driver compiles ahead, or None (NOLOCO_TRACE reads it).
  compile_stats = None

  def start(self, run) -> None:
    """After the state is built or restored (run.loop says which round is next), before the first step."""

  def due(self, step: int) -> bool:
    """Whether `after_step(step)` does round work (the trace times it as the round's)."""
    del step
    return False

  def before_step(self, run, step: int) -> None:
    """Before the inner step of `step`."""

  def after_step(self, run, step: int, metrics: dict) -> None:
    """After the inner step of `step` (`metrics`: its per-replica device arrays): the round boundary."""

  def settle(self, run) -> None:
    """Before a job-wide collective: nothing of this driver in flight, run.state complete for a save."""

  def close(self, failed: bool) -> None:
    """At the end, or on an error (`failed`: do not wait for partners that may be gone)."""


NoRounds = RoundDriver
