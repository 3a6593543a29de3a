"""What a traced job's rows say (experiments/lib/jobs.py): idle time against emulated device time, the real
step's share, tokens and bytes per second and per token, and validation loss over wall time.

Every figure counts from the job's origin (every process has finished its first step) to its wall-clock
budget, and leaves each process's first round out (it compiles): the measured rows.

Idle. With each step paced to its device time (jobs.device_time_faults), a process's device was busy for
the sum of its steps' device times, and idle the rest of its measured wall time: waiting for partners or
for an all-reduce, exchanging, and any real compute beyond the device time (`overrun_s`: this machine's
CPU, not the method; reported apart, so that a loaded machine shows as such). An evaluation (a barrier in
the lock-step schedule) and the logs run on the host within the steps' device time when they fit in it,
and count as overrun when they do not (a fast process waiting at an evaluation barrier for a slow one
too). `wait_fraction`: the share of the wall time outside the steps (in rounds: waiting, exchanging).

Pure functions of the rows (tests/test_bench_network.py builds synthetic ones).
"""

from __future__ import annotations

import numpy as np

from experiments.lib import async_runs
from experiments.lib import jobs


def measured_rows(trace: list[dict], first: int, start: float, budget_s: float | None) -> list[dict]:
  """A process's rows after its first `first` steps that began after the origin `start` (a process that
  started before the others has steps before it) and ended by the budget."""
  end = np.inf if budget_s is None else start + budget_s + 1e-9
  began = lambda r: r["end"] - (r["inner_s"] + r["slept_s"] + r["round_s"])
  return [r for r in trace[first:] if began(r) >= start - 1e-9 and r["end"] <= end]


def process_figures(rows: list[dict]) -> dict:
  """One process's measured rows: wall, device, idle, overrun and the real step's share of the device time."""
  inner = np.asarray([r["inner_s"] for r in rows])
  wall = float(sum(r["inner_s"] + r["slept_s"] + r["round_s"] for r in rows))
  device = float(sum(r.get("device_s", r["slept_s"]) for r in rows))
  overrun = float(sum(max(r["inner_s"] - r["device_s"], 0.0) for r in rows if "device_s" in r))
  rounds = float(sum(r["round_s"] for r in rows))
  return {"steps": len(rows), "wall_s": wall, "device_s": device, "round_s": rounds,
          "idle_fraction": 1.0 - device / wall if wall > 0 else 0.0,
          "wait_fraction": rounds / wall if wall > 0 else 0.0, "overrun_s": overrun,
          "overrun_fraction": overrun / wall if wall > 0 else 0.0,
          "real_step_share": float(inner.sum() / device) if device > 0 else None,
          "median_inner_s": float(np.median(inner)) if len(inner) else None}


def job_figures(traces: list[list[dict]], first: int, tokens_per_step: int, budget_s: float | None,
                processes: list[int] | None = None) -> dict:
  """Per process and for the job: idle fractions, tokens per second (all measured steps over the longest
  measured wall time), the real step's share; `tokens_per_step`: one replica's."""
  start = jobs.origin(traces)
  chosen = range(len(traces)) if processes is None else processes
  per = [process_figures(measured_rows(traces[p], first, start, budget_s)) for p in chosen]
  longest = max(p["wall_s"] for p in per)
  steps = sum(p["steps"] for p in per)
  shares = [p["real_step_share"] for p in per if p["real_step_share"] is not None]
  return {"processes": per, "idle_fraction": [p["idle_fraction"] for p in per],
          "wait_fraction": [p["wait_fraction"] for p in per],
          "tokens_per_s": steps * tokens_per_step / longest if longest > 0 else 0.0,
          "measured_steps": [p["steps"] for p in per], "measured_s": longest,
          "real_step_share": float(np.mean(shares)) if shares else None,
          "overrun_fraction": float(np.mean([p["overrun_fraction"] for p in per]))}


def lockstep_curve(traces: list[list[dict]], job_rows: list[dict]) -> list[list[float]]:
  """[seconds from the origin, eval/loss] of a lock-step job's evaluations (a barrier: every process has
  finished the step; the step-0 one left out)."""
  start = jobs.origin(traces)
  ends = [{r["step"]: r["end"] for r in t} for t in traces]
  return [[max(e[r["step"]] for e in ends) - start, r["eval/loss"]] for r in job_rows
          if "eval/loss" in r and r["step"] > 0 and all(r["step"] in e for e in ends)]


def async_curve(run: dict, processes: list[int] | None = None) -> list[list[float]]:
  """[seconds from the origin, job's validation loss] after every evaluation of any process, once every
  process has one (async_runs.loss_at: the mean of each one's latest)."""
  start, per = jobs.origin(run["traces"]), async_runs.curves(run)
  chosen = range(len(per)) if processes is None else processes
  times = sorted({t for p in chosen for t, _ in per[p] if t >= start})
  out = [[t - start, async_runs.loss_at(per, t, processes)] for t in times]
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
