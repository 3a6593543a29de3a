"""NOLOCO_FAULTS / NOLOCO_TRACE (tests, benchmarks): the injected delay, stall, kill or link drop after
each step, and the step's trace row (runtime/faults.py). Registered only when either is set."""

from __future__ import annotations

from noloco_jax.training.plugins.base import Plugin


class FaultInjection(Plugin):
  name = "faults"

  def after_step(self, run, step: int, metrics: dict) -> None:
    run.faults.after_step(step, run.state)
