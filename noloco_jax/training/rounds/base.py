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
the same way whatever the schedule. What the driver itself must keep across a restart (the step whose
exchange is in flight, the asynchronous schedule's progress and counters) goes through one method pair:
`save` (what a checkpoint keeps: LoopState.driver) and `restore` (from it, at `start`).

Implementations (training/rounds/__init__.py chooses one): `NoRounds` (ddp, none), `LockstepRounds`
(every H steps one compiled round, the next one's program compiled ahead), `OverlappedRounds` (the
exchange in flight for τ inner steps), `AsyncRounds` (partners found at run time). The two that train
while an exchange is in flight share `InFlight`. Cross-cutting behaviour wraps any of them (wrappers.py):
the nan_policy="skip_round" guard and NOLOCO_TRACE's round timing. A new schedule is one more driver.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable


class RoundDriver:
  """Base and `NoRounds`: a run without outer rounds (ddp, none) does nothing at any boundary."""

  # The round programs' background-compile stats (outer/programs.Stats), or None (NOLOCO_TRACE reads it).
  compile_stats = None

  def start(self, run) -> None:
    """After the state is built or restored (run.loop says which round is next), before the first step."""
    self.restore(run.loop.driver)

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

  def save(self) -> dict[str, Any]:
    """This driver's own record, JSON-able: what a checkpoint keeps of it (LoopState.driver)."""
    return {}

  def restore(self, record: dict[str, Any]) -> None:
    """From a checkpoint's record (`save`'s; {} for a fresh run)."""

  def scalars(self) -> dict[str, float]:
    """Cumulative counters every training row carries (the asynchronous schedule's)."""
    return {}

  def flush(self) -> None:
    """Every row of this driver's own logs is on disk (before the checkpoint that covers them)."""

  def close(self, failed: bool) -> None:
    """At the end, or on an error (`failed`: do not wait for partners that may be gone)."""


NoRounds = RoundDriver


class InFlight:
  """The one exchange in flight of a driver that trains meanwhile (overlapped, asynchronous).

  `send` starts `fn(*args)` at step `sent_at`, on a one-thread executor (`threaded`) or in order on the main
  thread. `result` waits for it (re-raising its error on the loop's thread) and hands it over once; the
  exchange stays open until the driver has merged it (`clear`). `info`: what the driver needs to merge it.
  """

  def __init__(self, threaded: bool, name: str):
    self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
                      if threaded else None)
    self._future = None  # its result to come: a Future, or the value; None once handed over (or restored)
    self.sent_at = 0  # the step whose exchange is open (0: none)
    self.info: dict[str, Any] = {}

  def send(self, step: int, fn: Callable, *args, **info) -> None:
    if self.sent_at:
      raise RuntimeError(f"step {step}: the exchange sent at step {self.sent_at} has not been merged.")
    self.sent_at, self.info = step, info
    self._future = self._executor.submit(fn, *args) if self._executor is not None else fn(*args)

  def open_from(self, step: int) -> None:
    """An exchange sent at `step` whose result the driver keeps already (a restored state's)."""
    self.sent_at, self._future = step, None

  def record(self) -> dict:
    """What a checkpoint keeps of it: the step it was sent at, if one is open (the result itself is in the
    state). The overlapped and streaming drivers save and restore through this pair."""
    return {"sent_at": self.sent_at} if self.sent_at else {}

  def reopen(self, record: dict) -> None:
    if record.get("sent_at"):
      self.open_from(record["sent_at"])

  @property
  def pending(self) -> bool:
    """Whether a result is still to be handed over."""
    return self._future is not None

  def done(self) -> bool:
    future = self._future
    return not isinstance(future, concurrent.futures.Future) or future.done()

  def result(self):
    future, self._future = self._future, None
    return future.result() if isinstance(future, concurrent.futures.Future) else future

  def clear(self) -> None:
    self._future, self.sent_at, self.info = None, 0, {}

  def close(self, failed: bool) -> None:
    """`failed`: an exchange blocked on a partner that failed must not hold the error up."""
    if self._executor is not None:
      self._executor.shutdown(wait=not failed, cancel_futures=True)
