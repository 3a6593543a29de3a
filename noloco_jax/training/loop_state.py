"""Everything the training loop carries across steps besides the TrainState: one record, checkpointed whole.

The Checkpointer saves `to_record()` in the checkpoint's meta item and hands back
`LoopState.from_record(...)` on resume, so the loop picks up exactly where it stopped: the same
step and outer round, the same cumulative bytes, the same history, and the training metrics fetched
since the last log but not yet logged (so a save between two log steps still resumes to the same
logged means).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from noloco_jax.io.checkpoint import records
from noloco_jax.outer.wire import Traffic


def _fresh_history() -> dict[str, Any]:
  return {"eval": []}


@dataclasses.dataclass
class LoopState:
  step: int = 0  # the last completed inner step (0: nothing trained yet)
  round: int = 0  # outer rounds completed
  # Cumulative bytes per replica (outer/wire.py): the collectives' operands
  # (comm/collective_operand_bytes_per_replica), and on the wire, sent and received (mean over
  # replicas; comm/bytes_sent_per_replica, comm/bytes_received_per_replica). None: restored from a
  # checkpoint written before the wire was counted, until `fill_wire_bytes`.
  comm_bytes: int = 0
  bytes_sent: float | None = 0.0
  bytes_received: float | None = 0.0
  # {"eval": [every evaluation's scalars], "train": the last train log, "skipped_rounds": [...]}
  history: dict[str, Any] = dataclasses.field(default_factory=_fresh_history)
  # Per-step metrics since the last log (device arrays until fetched; NumPy after a resume).
  pending_steps: list[int] = dataclasses.field(default_factory=list)
  pending_metrics: list[dict] = dataclasses.field(default_factory=list)  # {"loss": [N], "grad_norm": [N]}
  pending_rounds: list[tuple] = dataclasses.field(default_factory=list)  # (round metrics, weight std)
  # The round driver's own record (RoundDriver.save: e.g. the step whose exchange is in flight, whose group
  # mean the checkpointed state holds; the asynchronous schedule's progress and counters).
  driver: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Not checkpointed: the step at which the last round started (its message was sent) and the step at
  # which the last round's update was applied to the state (the same step but with streaming overlap).
  # Plug-ins read them: the pairing log writes a row when a round starts, the job-wide train log takes
  # the cross-replica weight std when one is applied.
  round_started_at: int = 0
  round_applied_at: int = 0

  @property
  def resumed(self) -> bool:
    return self.step > 0

  def add_step(self, step: int, metrics: dict, traffic: Traffic) -> None:
    self.step = step
    self._count(traffic)
    self.pending_steps.append(step)
    self.pending_metrics.append(metrics)  # device arrays: fetched only when logging

  def add_round(self, step: int, metrics: dict, traffic: Traffic, applied: bool = True) -> None:
    """Round `self.round` started at `step` (its metrics: device arrays; `traffic`: its bytes);
    `applied`: its update is in the state already (a lock-step round), else the round driver calls
    `round_applied` when it is."""
    self._count(traffic)
    self.pending_rounds.append((metrics, None))
    self.round += 1
    self.round_started_at = step
    if applied:
      self.round_applied_at = step

  def _count(self, traffic: Traffic) -> None:
    self.comm_bytes += traffic.operand
    self.bytes_sent += traffic.sent
    self.bytes_received += traffic.received

  def fill_wire_bytes(self, per_round: Traffic, per_step: Traffic) -> None:
    """After restoring a checkpoint that predates the wire counts: the steps and rounds done so far
    priced as the run's own (exact unless the run's replica count or message changed since)."""
    if self.bytes_sent is None:
      self.bytes_sent = self.round * per_round.sent + self.step * per_step.sent
      self.bytes_received = self.round * per_round.received + self.step * per_step.received

  def round_applied(self, step: int) -> None:
    self.round_applied_at = step

  def set_round_weight_std(self, weight_std) -> None:
    """The weight std after the last round's update (job-wide logging only); kept if still unlogged."""
    if self.pending_rounds:
      self.pending_rounds[-1] = (self.pending_rounds[-1][0], weight_std)

  def take_pending(self) -> tuple[list, list, list]:
    """(steps, metrics, rounds) since the last log; the record then holds none."""
    out = (self.pending_steps, self.pending_metrics, self.pending_rounds)
    self.pending_steps, self.pending_metrics, self.pending_rounds = [], [], []
    return out

  def to_record(self) -> dict[str, Any]:
    """JSON-able host values (fetches the pending device arrays: every process must call it)."""
    return {"step": int(self.step), "round": int(self.round), "comm_bytes": int(self.comm_bytes),
            "bytes_sent": float(self.bytes_sent), "bytes_received": float(self.bytes_received),
            "history": self.history, "driver": self.driver,
            "pending": records.pending_to_host(self.pending_steps, self.pending_metrics, self.pending_rounds)}

  @classmethod
  def from_record(cls, record: dict[str, Any]) -> "LoopState":
    steps, metrics, rounds = records.pending_from_host(record["pending"])
    history, driver = dict(record["history"]), record.get("driver")
    if driver is None:  # written before the driver kept its own record: where the drivers kept it then
      driver = {"sent_at": record["inflight_step"]} if record.get("inflight_step") else {}
      driver.update(history.pop("async", {}))
      if "schedule" in history:
        driver["counts"] = history.pop("schedule")
    return cls(step=record["step"], round=record["round"], comm_bytes=record["comm_bytes"],
               bytes_sent=record.get("bytes_sent"), bytes_received=record.get("bytes_received"),
               history=history, pending_steps=steps, pending_metrics=metrics, pending_rounds=rounds, driver=driver)
