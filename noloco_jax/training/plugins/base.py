"""The plug-in interface: optional work at the loop's fixed points, and the list that runs it.

A plug-in overrides what it needs of `Plugin`:

    start(run)               after the state is built or restored, before the first step
    after_step(run, step, metrics)  every step, after the round boundary: NO job-wide collective here (a
                             per-process log, a progress line, an injected fault)
    barrier_due(run, step)   whether it needs the job-wide barrier after `step` (same answer on every
                             process: a pure function of the step and what every process knows)
    at_barrier(run, step)    at a barrier step it asked for, after the round driver settled (nothing in
                             flight): collectives over all processes are allowed (evaluation, a checkpoint)
    flush(run)               every row this plug-in has produced so far is in its log, on disk
    end(run)                 the run finished normally (not called on an error)

Resources a plug-in opens are closed by the run's clean-up, registered as they open
(`run.on_exit(closer)`, training/run.py), so an error anywhere closes exactly what was opened.

`Plugins` calls the plug-ins in their registration order (training/plugins/__init__.py), which is
also the order of the promises they keep together: the training row of a step is written before its
evaluation row, and every log row is flushed before the checkpoint that covers it is started.
"""

from __future__ import annotations

import time


class Plugin:
  """Base of every plug-in: every method does nothing."""

  name = "plugin"  # the name its barrier time is reported under (progress lines)

  def start(self, run) -> None:
    pass

  def after_step(self, run, step: int, metrics: dict) -> None:
    pass

  def barrier_due(self, run, step: int) -> bool:
    del run, step
    return False

  def at_barrier(self, run, step: int) -> None:
    pass

  def flush(self, run) -> None:
    pass

  def end(self, run) -> None:
    pass


class Plugins:
  """The run's plug-ins, called in order; the time each spends at barriers goes to run.phase_seconds."""

  def __init__(self, plugins: list[Plugin]):
    self.plugins = list(plugins)

  def start(self, run) -> None:
    for p in self.plugins:
      p.start(run)

  def after_step(self, run, step: int, metrics: dict) -> None:
    for p in self.plugins:
      p.after_step(run, step, metrics)

  def barrier_due(self, run, step: int) -> bool:
    return any(p.barrier_due(run, step) for p in self.plugins)

  def at_barrier(self, run, step: int) -> None:
    """Each plug-in that asks for this barrier, in order (asked just before its turn: a stop agreed by
    one plug-in is a save for the next)."""
    for p in self.plugins:
      if not p.barrier_due(run, step):
        continue
      start = time.monotonic()
      p.at_barrier(run, step)
      run.phase_seconds[p.name] = run.phase_seconds.get(p.name, 0.0) + time.monotonic() - start

  def flush(self, run) -> None:
    for p in self.plugins:
      p.flush(run)

  def end(self, run) -> None:
    for p in self.plugins:
      p.end(run)

  def __iter__(self):
    return iter(self.plugins)
