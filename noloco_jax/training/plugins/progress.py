"""The loop's bookkeeping after every step: bounded dispatch, and a progress line every 30 s."""

from __future__ import annotations

from noloco_jax.io import writers
from noloco_jax.training.plugins import dispatch
from noloco_jax.training.plugins.base import Plugin


class Dispatch(Plugin):
  """The host stays at most a few steps ahead of the devices: queuing more deadlocks XLA:CPU's
  collectives (training/plugins/dispatch.py explains how). Not optional: every run registers it."""
  name = "dispatch"

  def __init__(self):
    self._window = dispatch.DispatchWindow()

  def after_step(self, run, step: int, metrics: dict) -> None:
    self._window.push(metrics["loss"])


class Progress(Plugin):
  """steps/s, % done, ETA, and the share of time spent at barriers by each plug-in (run.phase_seconds)."""
  name = "progress"

  def start(self, run) -> None:
    self._report = writers.ProgressLog(num_train_steps=run.config.num_steps, every_secs=30, parts=run.phase_seconds)

  def after_step(self, run, step: int, metrics: dict) -> None:
    self._report(step)
