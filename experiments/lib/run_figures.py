"""What a traced job's rows say (experiments/lib/jobs.py): idle time against emulated device time, the real
step's share, tokens and bytes per second and per token, and validation loss over wall time.

The clock. Every figure counts from the job's origin (every process has finished its first step) and
leaves out the time the job spent in its evaluations (`Clock`): the benchmark evaluates far more often
than a training run would, to draw its curves, and a lock-step evaluation is a barrier whose cost grows
with the link (the replicas' weight spread, replicas/weight_std, is two all-reduces of the model: 15 s
per evaluation at 10 Mbit/s, measured). An evaluation runs after step k (k a multiple of `every`), so it
lands in step k + 1's row (between the two steps): its time is what that row took beyond the step's
device time, `barrier_s`. The job's clock at a moment is the time since the origin less the evaluation
time so far (the most any process spent in them). Each process's first round (it compiles) is left out
too: the measured rows are the rest, up to the budget on that clock.

Idle. With each step paced to its device time (jobs.device_time_faults), a process's device was busy for
the sum of its steps' device times, and idle the rest of its measured time: waiting for partners or
for an all-reduce, exchanging, and any real compute beyond the device time (`overrun_s`: this machine's
CPU, not the method; reported apart, so that a loaded machine shows as such). `wait_fraction`: the share
of the time outside the steps (in rounds: waiting, exchanging).

Pure functions of the rows (tests/test_bench_network.py builds synthetic ones).
"""

from __future__ import annotations

import numpy as np

from experiments.lib import async_runs
from experiments.lib import jobs


def barrier_s(row: dict, every: int | None) -> float:
  """The evaluation (and whatever else ran at its barrier) before this row's step: the row's time beyond
  its device time, on the step after a multiple of `every` (0 elsewhere, or without `every`)."""
  if not every or row["step"] <= 1 or (row["step"] - 1) % every:
    return 0.0
  return max(row["inner_s"] - row.get("device_s", 0.0), 0.0)


class Clock:
  """A job's training clock: seconds since the origin less the evaluation time so far (module docstring)."""

  def __init__(self, traces: list[list[dict]], every: int | None):
    self.start = jobs.origin(traces)
    self._ends, self._sums = [], []
    for trace in traces:
      rows = [(r["end"], barrier_s(r, every)) for r in trace if r["end"] > self.start]
      self._ends.append(np.asarray([e for e, _ in rows]))
      self._sums.append(np.cumsum([b for _, b in rows]))

  def evaluations_s(self, t: float) -> float:
    """The most evaluation time any process had spent by time t (after the origin)."""
    spent = [sums[np.searchsorted(ends, t, side="right") - 1] if len(ends) and ends[0] <= t else 0.0
             for ends, sums in zip(self._ends, self._sums)]
    return float(max(spent)) if spent else 0.0

  def __call__(self, t: float) -> float:
    return t - self.start - self.evaluations_s(t)


def measured_rows(trace: list[dict], first: int, clock: Clock, budget_s: float | None) -> list[dict]:
  """A process's rows after its first `first` steps that began after the origin (a process that started
  before the others has steps before it) and ended by the budget on the job's clock."""
  began = lambda r: r["end"] - (r["inner_s"] + r["slept_s"] + r["round_s"])
  return [r for r in trace[first:] if began(r) >= clock.start - 1e-9
          and (budget_s is None or clock(r["end"]) <= budget_s + 1e-9)]


def process_figures(rows: list[dict], every: int | None = None) -> dict:
  """One process's measured rows: time (evaluations left out), device time, idle, overrun and the real
  step's share of the device time."""
  barriers = [barrier_s(r, every) for r in rows]
  inner = np.asarray([r["inner_s"] for r in rows]) - np.asarray(barriers)
  wall = float(sum(r["inner_s"] + r["slept_s"] + r["round_s"] for r in rows) - sum(barriers))
  device = float(sum(r.get("device_s", r["slept_s"]) for r in rows))
  overrun = float(sum(max(i - r["device_s"], 0.0) for i, r in zip(inner, rows) if "device_s" in r))
  rounds = float(sum(r["round_s"] for r in rows))
  return {"steps": len(rows), "wall_s": wall, "device_s": device, "round_s": rounds,
          "evaluations_s": float(sum(barriers)),
          "idle_fraction": 1.0 - device / wall if wall > 0 else 0.0,
          "wait_fraction": rounds / wall if wall > 0 else 0.0, "overrun_s": overrun,
          "overrun_fraction": overrun / wall if wall > 0 else 0.0,
          "real_step_share": float(inner.sum() / device) if device > 0 else None,
          "median_inner_s": float(np.median(inner)) if len(inner) else None}


def job_figures(traces: list[list[dict]], first: int, tokens_per_step: int, budget_s: float | None,
                processes: list[int] | None = None, every: int | None = None) -> dict:
  """Per process and for the job: idle fractions, tokens per second (all measured steps over the longest
  measured time), the real step's share; `tokens_per_step`: one replica's; `every`: the steps between
  evaluations (their time is left out)."""
  clock = Clock(traces, every)
  chosen = range(len(traces)) if processes is None else processes
  per = [process_figures(measured_rows(traces[p], first, clock, budget_s), every) for p in chosen]
  longest = max(p["wall_s"] for p in per)
  steps = sum(p["steps"] for p in per)
  shares = [p["real_step_share"] for p in per if p["real_step_share"] is not None]
  return {"processes": per, "idle_fraction": [p["idle_fraction"] for p in per],
          "wait_fraction": [p["wait_fraction"] for p in per],
          "tokens_per_s": steps * tokens_per_step / longest if longest > 0 else 0.0,
          "measured_steps": [p["steps"] for p in per], "measured_s": longest,
          "evaluations_s": max(p["evaluations_s"] for p in per),
          "real_step_share": float(np.mean(shares)) if shares else None,
          "overrun_fraction": float(np.mean([p["overrun_fraction"] for p in per]))}


def lockstep_curve(traces: list[list[dict]], job_rows: list[dict], clock: Clock) -> list[list[float]]:
  """[the job's clock, eval/loss] of a lock-step job's evaluations, at the end of the step evaluated (every
  process's: a barrier; the step-0 one left out)."""
  ends = [{r["step"]: r["end"] for r in t} for t in traces]
  return [[clock(max(e[r["step"]] for e in ends)), r["eval/loss"]] for r in job_rows
          if "eval/loss" in r and r["step"] > 0 and all(r["step"] in e for e in ends)]


def async_curve(run: dict, clock: Clock, processes: list[int] | None = None) -> list[list[float]]:
  """[the job's clock, job's validation loss] after every evaluation of any process, once every process
  has one (async_runs.loss_at: the mean of each one's latest)."""
  per = async_runs.curves(run)
  chosen = range(len(per)) if processes is None else processes
  times = sorted({t for p in chosen for t, _ in per[p] if t >= clock.start})
  out = [[clock(t), async_runs.loss_at(per, t, processes)] for t in times]
  return [point for point in out if point[1] is not None]


def time_to_target(curve: list[list[float]], target: float | None, budget_s: float | None) -> float | None:
  """The first time the curve is at or below `target` within the budget (None if never)."""
  if target is None:
    return None
  return next((t for t, v in curve if v <= target and (budget_s is None or t <= budget_s + 1e-9)), None)


def loss_at_budget(curve: list[list[float]], budget_s: float | None) -> float | None:
  """The latest point of the curve by the budget."""
  before = [v for t, v in curve if budget_s is None or t <= budget_s + 1e-9]
  return before[-1] if before else None


def wire_bytes_per_token(samples: list[tuple[float, list[int]]], traces: list[list[dict]], clock: Clock,
                         budget_s: float | None, every: int | None, tokens_per_step: int) -> float | None:
  """Bytes a node sent on its link per token it trained on, from the kernel's counters polled during the
  job (`samples`: (time, each node's bytes sent so far)), over the polls between the origin and the budget
  on the job's clock and outside every evaluation (a row with barrier_s > 0 began with one): the training's
  own traffic, headers included. The mean over nodes."""
  began = lambda r: r["end"] - (r["inner_s"] + r["slept_s"] + r["round_s"])
  evaluations = [(began(r), began(r) + barrier_s(r, every)) for t in traces for r in t if barrier_s(r, every) > 0]
  kept, sent = [], np.zeros(len(traces))
  for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
    if t0 < clock.start or (budget_s is not None and clock(t1) > budget_s):
      continue
    if any(t0 < e1 and t1 > e0 for e0, e1 in evaluations):
      continue
    kept.append((t0, t1))
    sent += np.asarray(c1) - np.asarray(c0)
  if not kept:
    return None
  starts, ends = np.asarray(kept).T
  def steps_in(trace):  # the steps that ended within a kept interval
    t = np.asarray([r["end"] for r in trace])
    i = np.searchsorted(ends, t, side="left")
    return int(np.sum((i < len(ends)) & (t > starts[np.minimum(i, len(ends) - 1)])))
  steps = [steps_in(t) for t in traces]
  per = [b / (n * tokens_per_step) for b, n in zip(sent, steps) if n]
  return float(np.mean(per)) if per else None


def bytes_figures(sent_per_replica: float | None, steps_per_replica: float, tokens_per_step: int,
                  tokens_per_s: float, processes: int) -> dict:
  """Bytes a replica sent (the run's accounting, noloco_jax/outer/wire.py): per run, per token it trained
  on, and per second at the job's measured tokens/s."""
  if not sent_per_replica or not steps_per_replica:
    return {"bytes_per_run": sent_per_replica, "bytes_per_token": None, "bytes_per_s": None}
  per_token = sent_per_replica / (steps_per_replica * tokens_per_step)
  return {"bytes_per_run": sent_per_replica, "bytes_per_token": per_token,
          "bytes_per_s": per_token * tokens_per_s / processes}


def async_rounds(pairings: list[list[dict]], processes: list[int] | None = None) -> dict:
  """Shares of an asynchronous job's rounds (every process's pairing log, the first round included):
  skipped (no partner within max_wait_s), failed (the exchange did not complete), and of the exchanges,
  those in a group of three (an odd batch: 2 copies sent instead of 1)."""
  chosen = range(len(pairings)) if processes is None else processes
  rows = [r for p in chosen for r in pairings[p]]
  count = lambda status: sum(r.get("status") == status for r in rows)
  exchanged = [r for r in rows if r.get("status") == "exchanged"]
  total = max(len(rows), 1)
  triples = sum(len(r.get("group") or ()) == 3 for r in exchanged)
  return {"rounds": len(rows), "skipped_fraction": count("skipped") / total, "failed_fraction": count("failed") / total,
          "triples_share": triples / len(exchanged) if exchanged else 0.0}
