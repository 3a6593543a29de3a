"""Multi-process benchmark jobs on this machine: emulated device time, a traced job run to a stop rule, and
whether the machine can place it (experiments/bench_network.py; reusable by any benchmark of processes).

Emulated device time. A benchmark's model is small enough for P processes to share two CPU cores, so a
step's real compute (a few ms) is not what an accelerator would take. Each step is instead paced to a
device time (NOLOCO_FAULTS `pace`, runtime/faults.py): the process sleeps the device time less the step's
own compute, which it waits for, so a step takes max(device time, real compute) whatever the machine's
load, as long as the real compute fits in it. `device_time_faults` writes the spec (every process `step_s`,
one straggler `factor` × as long, or seeded log-normal times per step) and `device_times` the very times
the processes are paced to, for the latency model.

    faults = jobs.device_time_faults(0.1, straggler_factor=2.0)
    run = jobs.run_job(flags, 8, workdir, {"NOLOCO_FAULTS": faults}, jobs.stop_after(60.0),
                       wrap=fabric.wrap, port=port)       # per-node links: experiments/lib/node_links.py

A traced job (NOLOCO_TRACE) writes one row per step and process: {step, inner_s, round_s, slept_s,
device_s, end} (runtime/faults.py). The time origin of a job is the moment every process has finished its
first step (all started, the first step compiled).
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

# Resident memory of one process of a benchmark job (JAX on CPU, a 1M-parameter model, its data pipeline),
# with room: measured 0.45-0.55 GB on this machine (bench_network, P = 8).
PROCESS_BYTES = 0.8e9


def device_time_faults(step_s: float, straggler_factor: float = 1.0, lognormal: tuple[float, float] | None = None,
                       straggler: int = 0, seed: int = 0) -> str:
  """NOLOCO_FAULTS pacing every step to its device time: `step_s` (process `straggler` `straggler_factor` ×
  as long), or with `lognormal` = (median, sigma) a seeded log-normal time per step on every process."""
  if lognormal:
    median, sigma = lognormal
    return f"pace:seconds={median},sigma={sigma},seed={seed}"
  spec = f"pace:seconds={step_s}"
  if straggler_factor != 1.0:
    spec += f";pace:process={straggler},seconds={step_s * straggler_factor}"
  return spec


def device_times(processes: int, steps: int, step_s: float, straggler_factor: float = 1.0,
                 lognormal: tuple[float, float] | None = None, straggler: int = 0, seed: int = 0) -> np.ndarray:
  """[steps, P] the device times `device_time_faults` paces the processes to (the same seeded draws)."""
  if lognormal:
    return latency.lognormal_step_times(processes, steps, *lognormal, seed=seed)
  return latency.straggler_step_times(processes, steps, step_s, straggler_factor, straggler)


def check_placement(processes: int, flag: str = "--processes", process_bytes: float = PROCESS_BYTES,
                    limit: int | None = None) -> None:
  """One line naming `flag` (exit 2) when this machine cannot hold `processes` processes of
  `process_bytes` each in the memory it has available now (or more than `limit`, e.g. addresses)."""
  with open("/proc/meminfo") as f:
    available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
  most = int(available // process_bytes)
  if limit is not None:
    most = min(most, limit)
  if processes > most:
    harness.usage_error(f"{flag}={processes}: this machine can place at most {most} processes of this job "
                        f"({available / 1e9:.1f} GB available, {process_bytes / 1e9:.1f} GB each"
                        f"{f', {limit} addresses' if limit is not None else ''}); run fewer.")


def read_traces(trace_dir: str, processes: int) -> list[list[dict]]:
  """Each process's trace rows so far (a partly written last line is left out)."""
  return [metrics_lib.read_jsonl(os.path.join(trace_dir, f"trace_{p}.jsonl"), missing_ok=True, skip_damaged=True)
          for p in range(processes)]


def origin(traces: list[list[dict]]) -> float | None:
  """When every process had finished its first step (None before)."""
  if not all(traces):
    return None
  return max(t[0]["end"] for t in traces)


def stop_after(seconds: float, min_steps: int = 0) -> Callable:
  """Stop once `seconds` have passed since the origin (and every live process has `min_steps` steps)."""
  def stop(traces, now):
    start = origin(traces)
    return start is not None and now - start >= seconds and min(len(t) for t in traces) >= min_steps
  return stop


def stop_at_steps(steps: int) -> Callable:
  """Stop once every process has taken `steps` steps (the slowest decides)."""
  return lambda traces, now: all(len(t) >= steps for t in traces)


def never(traces, now) -> bool:
  """Let the job run to its own end (num_steps)."""
  del traces, now
  return False


def run_job(flags: list[str], processes: int, workdir: str, env: dict, stop: Callable[[list[list[dict]], float], bool],
            *, keep_going: bool = True, timeout_s: float = 1800.0, poll_s: float = 0.2, wrap=None,
            port: int = 0) -> dict:
  """Runs `python -m noloco_jax.main FLAGS` as P traced processes until `stop(traces, now)` (then SIGTERM to
  every process: each saves and exits 0, a lock-step job at a step they agree on; runtime/preemption.py) or
  until every process has exited.

  `keep_going`: a process that dies (an injected kill) does not stop the others (the asynchronous
  schedule); else the first failure stops the job. `wrap`, `port`: launch_local.Job's (per-node links).
  Returns the traces, each process's metrics rows and pairing logs (asynchronous: WORKDIR/process_<i>/;
  lock-step: the job's own WORKDIR/metrics.jsonl as `job_rows`), the exit statuses, the log paths and the
  time the stop was sent (None if the job ended by itself).
  """
  trace_dir = os.path.join(workdir, "trace")
  job = launch_local.Job(processes, 1, flags, log_dir=workdir + "_logs", cwd=harness.REPO, wrap=wrap, port=port,
                         env={"NOLOCO_TRACE": trace_dir, "NOLOCO_HEARTBEAT_TIMEOUT_S": "60", **env})
  deadline, stopped_at = time.time() + timeout_s, None
  try:
    while any(p.poll() is None for p in job.procs):
      if time.time() > deadline:
        raise RuntimeError(f"the job in {workdir} did not finish in {timeout_s} s")
      failed = [p.returncode for p in job.procs if p.poll() not in (None, 0)]
      if failed and not keep_going:
        break
      if stopped_at is None and stop(read_traces(trace_dir, processes), time.time()):
        job.forward(signal.SIGTERM)
        stopped_at = time.time()
      time.sleep(poll_s)
  finally:
    _end(job.procs)
  codes = [p.wait() for p in job.procs]
  process_dirs = [os.path.join(workdir, f"process_{p}") for p in range(processes)]
  read = lambda path: metrics_lib.read_jsonl(path, missing_ok=True)
  return {"traces": read_traces(trace_dir, processes), "codes": codes,
          "rows": [read(os.path.join(d, "metrics.jsonl")) for p, d in enumerate(process_dirs)],
          "pairings": [read(os.path.join(d, f"pairings_{p}.jsonl")) for p, d in enumerate(process_dirs)],
          "job_rows": read(os.path.join(workdir, "metrics.jsonl")),
          "job_pairings": read(os.path.join(workdir, "pairings.jsonl")),
          "log_paths": job.log_paths, "stopped_at": stopped_at}


def _end(procs, grace_s: float = 20.0) -> None:
  """Whatever still runs: SIGTERM, then after `grace_s` SIGKILL (never leaves a process behind)."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    p.send_signal(signal.SIGTERM)
  end = time.time() + grace_s
  while time.time() < end and any(p.poll() is None for p in alive):
    time.sleep(0.1)
  for p in alive:
    if p.poll() is None:
      p.kill()


def failure_tail(run: dict, chars: int = 2000) -> str:
  """The last lines of every process's log (what a failed job's report ends with)."""
  return "".join(open(path).read()[-chars:] for path in run["log_paths"] if path and os.path.exists(path))
