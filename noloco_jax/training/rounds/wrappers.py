"""Behaviour that applies to any round driver, written once: the skip-round guard and the round trace.

- `Guarded` (nan_policy="skip_round"): the RoundGuard of io/checkpoint/guard.py snapshots the state at
  a round's start, watches its losses, and after the round boundary undoes a round that produced a
  non-finite loss or state.
- `Traced` (NOLOCO_TRACE, benchmarks): the injector of runtime/faults.py waits for the inner
  step before a round boundary and times the boundary's work (the exchange and any wait for partners)
  and the round's wait for its compiled program.
"""

from __future__ import annotations

from noloco_jax.training.rounds.base import RoundDriver


class _Wrapper:
  """Forwards every call of the driver interface to `inner`; subclasses add their part around it."""

  def __init__(self, inner: RoundDriver):
    self.inner = inner

  def __getattr__(self, name):  # what a subclass does not define itself
    return getattr(self.inner, name)


class Guarded(_Wrapper):
  """Undoes a round whose loss or state is not finite (io/checkpoint/guard.RoundGuard)."""

  def __init__(self, inner: RoundDriver, guard):
    super().__init__(inner)
    self._guard = guard

  def before_step(self, run, step: int) -> None:
    self._guard.begin(step, run.state)
    self.inner.before_step(run, step)

  def after_step(self, run, step: int, metrics: dict) -> None:
    self._guard.observe(metrics["loss"])
    self.inner.after_step(run, step, metrics)
    run.state = self._guard.end(step, run.state, run.loop.history)


class Traced(_Wrapper):
  """Times each round boundary for NOLOCO_TRACE (faults.Injector.before_round / after_program)."""

  def __init__(self, inner: RoundDriver, injector):
    super().__init__(inner)
    self._injector = injector

  def after_step(self, run, step: int, metrics: dict) -> None:
    if not self.inner.due(step):
      self.inner.after_step(run, step, metrics)
      return
    self._injector.before_round(run.state)  # the inner step's end (waited for), the round's start
    stats = self.inner.compile_stats
    waits = len(stats.waits_s) if stats is not None else 0
    self.inner.after_step(run, step, metrics)
    stats = self.inner.compile_stats
    if stats is not None and len(stats.waits_s) > waits:  # this boundary fetched a compiled program
      self._injector.after_program(stats)
