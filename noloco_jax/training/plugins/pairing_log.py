"""pairings.jsonl: every round's grouping (process 0), one row when the round starts.

Every process derives the groupings from (seed, round) (outer/pairing.py); the log is for readers and
for elastic resumes (io/checkpoint/resize.py reads who was paired with whom). A round_robin round
also names its matching.
"""

from __future__ import annotations

import os

from noloco_jax.io import checkpoint as checkpoint_lib
from noloco_jax.training.plugins.base import Plugin


class PairingLog(Plugin):
  name = "pairings"

  def __init__(self, schedule):
    self._schedule, self._log = schedule, None

  def start(self, run) -> None:
    self._log = checkpoint_lib.JsonlLog(os.path.join(run.workdir, "pairings.jsonl"))
    run.on_exit(lambda failed: self._log.close())

  def after_step(self, run, step: int, metrics: dict) -> None:
    if run.loop.round_started_at != step:
      return
    self._log.append(checkpoint_lib.records.pairing_row(self._schedule, run.loop.round - 1, step))  # the round started here

  def flush(self, run) -> None:
    if self._log is not None:
      self._log.sync()
