"""The asynchronous schedule in experiments/bench_network.py: its job, what is read from it, and its model.

An asynchronous job has no common end: each process trains at its own pace. So the benchmark gives it a
wall-clock budget instead of a step count, the longest training time of the lock-step jobs it is
compared with (or, run alone, the time its slowest process takes for the lock-step jobs' steps), and
stops every process then with SIGTERM (each saves and exits 0; runtime/preemption.py).

Every process evaluates its own replica every round (no barrier in this schedule), so its validation
loss is known over time: the job's validation loss at wall time t is the mean over processes of each
one's latest evaluation by t. Time origin, for every job: the moment every process has finished its
first inner step (all started, the first step compiled), from the NOLOCO_TRACE rows (runtime/faults.py:
one row per step with its end time).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import numpy as np

from experiments.lib import harness
from experiments.lib import latency
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import launch_local


def read_traces(trace_dir: str, processes: int) -> list[list[dict]]:
  """Each process's trace rows so far (a partly written last line is left out)."""
  return [metrics_lib.read_jsonl(os.path.join(trace_dir, f"trace_{p}.jsonl"), missing_ok=True, skip_damaged=True)
          for p in range(processes)]


def origin(traces: list[list[dict]]) -> float | None:
  """When every process had finished its first step (None before)."""
  if not all(traces):
    return None
  return max(t[0]["end"] for t in traces)


def run_job(flags: list[str], processes: int, workdir: str, env: dict, stop: Callable[[list[list[dict]], float], bool],
            timeout_s: float = 1200.0, poll_s: float = 0.2) -> dict:
  """Runs the job until `stop(traces, now)` (then SIGTERM to every process) and every process has exited.

  A process that dies (an injected kill) does not stop the others. Returns the traces, each process's
  metrics rows and pairing log, and the exit statuses.
  """
  trace_dir = os.path.join(workdir, "trace")
  job = launch_local.Job(processes, 1, flags, log_dir=workdir + "_logs", cwd=harness.REPO,
                         env={"NOLOCO_TRACE": trace_dir, "NOLOCO_HEARTBEAT_TIMEOUT_S": "60", **env})
  deadline, stopped = time.time() + timeout_s, False
  try:
    while any(p.poll() is None for p in job.procs):
      if time.time() > deadline:
        raise RuntimeError(f"the asynchronous job in {workdir} did not finish in {timeout_s} s")
      if not stopped and stop(read_traces(trace_dir, processes), time.time()):
        job.forward(signal.SIGTERM)
        stopped = True
      time.sleep(poll_s)
  finally:
    for p in job.procs:
      if p.poll() is None:
        p.kill()
  codes = [p.wait() for p in job.procs]
  process_dirs = [os.path.join(workdir, f"process_{p}") for p in range(processes)]
  read = lambda path: metrics_lib.read_jsonl(path, missing_ok=True)
  return {"traces": read_traces(trace_dir, processes), "codes": codes,
          "rows": [read(os.path.join(d, "metrics.jsonl")) for p, d in enumerate(process_dirs)],
          "pairings": [read(os.path.join(d, f"pairings_{p}.jsonl")) for p, d in enumerate(process_dirs)],
          "log_paths": job.log_paths}


def stop_after(seconds: float, min_steps: int = 0) -> Callable:
  """Stop once `seconds` have passed since the origin (and every live process has `min_steps` steps)."""
  def stop(traces, now):
    start = origin(traces)
    return start is not None and now - start >= seconds and min(len(t) for t in traces) >= min_steps
  return stop


def stop_at_steps(steps: int) -> Callable:
  """Stop once every process has taken `steps` steps (the slowest decides)."""
  return lambda traces, now: all(len(t) >= steps for t in traces)


def curves(run: dict) -> list[list[tuple[float, float]]]:
  """Per process: (time, eval/loss) of every evaluation, in order; the step-0 evaluation at −inf."""
  out = []
  for trace, rows in zip(run["traces"], run["rows"]):
    ends = {r["step"]: r["end"] for r in trace}
    points = [(-np.inf if r["step"] == 0 else ends[r["step"]], r["eval/loss"]) for r in rows
              if "eval/loss" in r and (r["step"] == 0 or r["step"] in ends)]
    out.append(points)
  return out


def loss_at(process_curves, t: float, processes=None) -> float | None:
  """Mean over `processes` (default all) of each one's latest evaluation by time t."""
  chosen = range(len(process_curves)) if processes is None else processes
  values = []
  for p in chosen:
    before = [v for when, v in process_curves[p] if when <= t]
    if not before:
      return None
    values.append(before[-1])
  return float(np.mean(values))


def time_of_tokens(traces: list[list[dict]], steps: int) -> float | None:
  """The first time by which the processes' steps add up to `steps` (None if they never do)."""
  ends = sorted(r["end"] for t in traces for r in t)
  return ends[steps - 1] if len(ends) >= steps else None


def summarise(run: dict, inner_steps: int, tokens_per_step: int, processes: list[int] | None = None,
              overlapped: bool = False) -> dict:
  """bench_network.summarise's figures for an asynchronous job (`tokens_per_step`: one replica's).

  `overlapped`: the job ran its rounds on their own thread (outer.overlap.steps > 0), so a round's
  waiting and exchange went on while the steps did, and are not parts of the time the loop spent in it.

  Idle: the time in rounds (finding a partner, the exchange, the update, a skipped round's wait) over
  all time, each process from its second round on. Tokens/s: every process's steps from its second
  round on, over the longest such span of any process. Bytes: the mean over processes of their
  cumulative per-replica figures.
  """
  processes = list(range(len(run["traces"]))) if processes is None else processes
  per_process, steps, spans = [], 0, []
  for p in processes:
    rows = run["traces"][p][inner_steps:]
    inner = np.asarray([r["inner_s"] for r in rows])
    wait = np.asarray([r["round_s"] for r in rows])
    slept = np.asarray([r["slept_s"] for r in rows])
    busy = inner + slept
    total = float((busy + wait).sum())
    per_process.append({"idle_fraction": float(wait.sum() / max(total, 1e-12)), "busy_s": float(busy.sum()),
                        "wait_s": float(wait.sum()), "slept_s": float(slept.sum()), "steps": len(rows),
                        "median_inner_s": float(np.median(inner)) if len(inner) else 0.0, "program_wait_s": 0.0})
    steps += len(rows)
    spans.append(total)
  last = [[r for r in rows if "train/loss" in r][-1] for rows in (run["rows"][p] for p in processes)]
  mean = lambda key: float(np.mean([r.get(key, 0.0) for r in last]))
  exchange = [x["exchange_s"] for p in processes for x in run["pairings"][p] if x["status"] == "exchanged"]
  rounds = [max(pp["steps"] // inner_steps, 1) for pp in per_process]
  # Where a round's time goes, per round, mean over processes (from the second round on): the loop's time
  # in it (round_s), ready until grouped or given up (waiting_s), the exchange, and, with the round on the
  # loop's own thread, the rest (the message and update programs, store calls, logs). With the round on its
  # own thread, waiting and exchange overlap the steps: no rest can be subtracted (other_s is None).
  pairing_rows = [x for p in processes for x in run["pairings"][p][1:]]
  in_rounds = float(np.mean([pp["wait_s"] / r for pp, r in zip(per_process, rounds)]))
  waiting = float(np.mean([x["waited_s"] for x in pairing_rows])) if pairing_rows else 0.0
  exchanging = float(np.mean([x["exchange_s"] for x in pairing_rows])) if pairing_rows else 0.0
  breakdown = {"round_s": in_rounds, "waiting_s": waiting, "exchange_s": exchanging,
               "other_s": None if overlapped else in_rounds - waiting - exchanging, "overlapped": overlapped}
  return {"method": "async", "wall_s_per_round": float(np.median([s / r for s, r in zip(spans, rounds)])),
          "longest_round_s_median": float("nan"), "tokens_per_s": steps * tokens_per_step / max(spans),
          "bytes_sent_per_replica": mean("comm/bytes_sent_per_replica"),
          "bytes_received_per_replica": mean("comm/bytes_received_per_replica"),
          "collective_operand_bytes_per_replica": mean("comm/collective_operand_bytes_per_replica"),
          "idle_fraction": [pp["idle_fraction"] for pp in per_process], "program_wait_s": [0.0] * len(per_process),
          "processes": per_process, "measured_s": max(spans),
          "rounds": {k: int(sum(r.get(f"async/{k}_rounds", 0) for r in last)) for k in ("exchanged", "skipped", "failed")},
          "exchange_s_median": float(np.median(exchange)) if exchange else 0.0, "round_breakdown": breakdown}


def model(step_times: np.ndarray, inner_steps: int, *, window_s: float, max_wait_s: float, exchange_s: float,
          until_s: float, seed: int, tokens_per_step: int) -> dict:
  """latency.async_schedule's figures in bench_network's model columns (`tokens_per_step`: one replica's)."""
  out = latency.async_schedule(step_times, inner_steps, window_s=window_s, max_wait_s=max_wait_s,
                               exchange_s=exchange_s, until_s=until_s, seed=seed)
  return {"wall_s_per_round": out["wall_s_per_round"], "idle_fraction": out["idle_fraction"],
          "busy_s": out["busy_s"], "skips": out["skips"], "rounds": out["rounds"],
          "tokens_per_s": out["steps_per_s"] * tokens_per_step}
