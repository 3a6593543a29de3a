"""A `jax.profiler` trace of chosen training steps, as a plug-in of the training loop.

`Profiler(workdir, first, last)` records steps first..last (inclusive) into WORKDIR/profile/: the
trace starts just before step `first` runs and stops once step `last`'s work is finished on the
device. Choose a range that contains a multiple of H (outer.inner_steps) to capture an outer round
as well as inner steps. The files are what `jax.profiler`
writes: `plugins/profile/<time>/<host>.xplane.pb` (TensorBoard's profile plugin:
`tensorboard --logdir WORKDIR/profile`) and, with `perfetto=True` (the default), a
`perfetto_trace.json.gz` beside it, which ui.perfetto.dev opens.

A plug-in (training/plugins/base.py), registered when config.profile_steps = "FIRST,LAST":
  start(run)             step `first` = 1 (or the first step after a resume): the trace starts here
  after_step(run, step)  starts the trace after step first−1; stops it after step `last`
  end(run)               stops a trace still running (a run that ended inside the range); the run's
                         clean-up does the same for a run that failed inside it
What it reads from `run`: run.state (blocked on before stopping, so the last step's device work is
inside the trace) and, in `start`, run.loop.step (the step the loop starts after; 0 for a fresh run).
Every process records its own trace (file names carry the host); nothing here communicates.
"""

from __future__ import annotations

import os

import jax

from noloco_jax.config import run as run_schema
from noloco_jax.training.plugins.base import Plugin

PROFILE_DIR = "profile"


parse_steps = run_schema.parse_steps  # config.profile_steps: checked with the config (config/run.py)


class Profiler(Plugin):
  """Records a jax.profiler trace of steps first..last into workdir/profile."""

  name = "profile"

  def __init__(self, workdir: str, first: int, last: int, *, perfetto: bool = True):
    if not 1 <= first <= last:
      raise ValueError(f"profile steps ({first}, {last}): need 1 <= FIRST <= LAST.")
    self.log_dir = os.path.join(os.path.abspath(workdir), PROFILE_DIR)
    self.first, self.last, self._perfetto = first, last, perfetto
    self.active = False
    self.recorded: tuple[int, int] | None = None  # the steps actually inside the finished trace

  def _start(self, step_next: int) -> None:
    os.makedirs(self.log_dir, exist_ok=True)
    jax.profiler.start_trace(self.log_dir, create_perfetto_trace=self._perfetto)
    self.active, self._from = True, step_next

  def _stop(self, run, step: int) -> None:
    if run is not None and getattr(run, "state", None) is not None:
      jax.block_until_ready(run.state)  # the last step's device work inside the trace
    jax.profiler.stop_trace()
    self.active, self.recorded = False, (self._from, step)

  def start(self, run) -> None:
    run.on_exit(lambda failed: self.close())  # a run that fails inside the range stops the trace too
    begun = int(run.loop.step)  # the loop runs steps begun+1, ...
    if begun + 1 >= self.first and begun < self.last and not self.active:
      self._start(begun + 1)

  def after_step(self, run, step: int, metrics: dict) -> None:
    if step == self.first - 1 and not self.active and self.recorded is None:
      self._start(step + 1)
    elif step >= self.last and self.active:
      self._stop(run, step)

  def end(self, run) -> None:
    if self.active:
      self._stop(run, int(run.loop.step))

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
