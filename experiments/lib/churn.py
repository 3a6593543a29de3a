"""experiments/bench_churn.py's pieces: the failure trace, the supervisor of one job under it, and what is read
from the job afterwards (goodput, time lost per failure, the audit).

The failure trace (`failure_trace`, pure): each process fails as a Poisson process of rate 1/mtbf_s, drawn
from (seed, process) alone, so every method of a sweep meets the same failures at the same moments (in
seconds from the job's origin: the moment every process has finished its first step).

The supervisor (`run`), one job, P processes on one machine:

- asynchronous NoLoCo: the coordination service in a process of its own (docs/async.md §5: a process of
  the job may then die, process 0 included), P training processes. A failure SIGKILLs that process; after
  `restart_delay_s` the supervisor starts it again with the same slot, and it rejoins from a live peer.
  A failure that hits a process already down (waiting or starting) is skipped: it is not counted.
- lock-step NoLoCo, DiLoCo, DDP: one `jax.distributed` job. A failure SIGKILLs the process, and the
  supervisor kills the rest at once (a lock-step job cannot go on without it; the others would fail at
  their next collective: the time they take to notice is not charged, so lock-step's loss is a lower
  bound); after `restart_delay_s` it starts the whole job again with the same command, which resumes
  from its last checkpoint. A failure during the wait is skipped; one while the job starts restarts it.
  `checkpoint.elastic` does not apply: the whole job comes back with its P processes.
- at `budget_s` from the origin every running process gets SIGTERM (it saves and exits).

Accounting (`account`):

- tokens that contributed to the surviving model: lock-step, the last checkpoint's step × P × tokens per
  step (steps done again after a restart count once), at most the last step ended within the budget. Asynchronous, per process and incarnation: a killed
  incarnation's steps up to its last exchange that completed (merged into its partners: its pairings log,
  copied when it was killed, before its restart rewrites it), the surviving incarnation's up to its last
  step ended within the budget; a restarted incarnation counts only steps beyond what its previous one counted (a restart that
  resumes from its own checkpoint redoes steps, which count once).
- goodput = those tokens ÷ (P × budget_s × a healthy process's tokens/s); healthy: the most steps per
  second per process that any run of the sweep made before its first failure (from the origin to the
  first kill, at least 5 s), rounds, evaluations and checkpoints included: the best pace the machine
  allowed any schedule, so a schedule's own waiting counts against it as failures do (and so does a
  machine busier during this run than during the fastest one). goodput_own_pace: against the run's own
  pace before its first failure instead (None when that stretch is under 5 s): the failures' cost alone.
- where a failure's time goes (`phases`, from the restarted process's log): the restart delay, start-up
  (interpreter, imports, config), init (control plane, data, state), restore, join, compile, first step.
  `partner_wait_s`: what the partners of the dead waited in rounds that did not exchange.
- time lost per failure: from the kill to the first step after the restart (the job's, or that process's),
  plus the steps lost (lock-step: since the last checkpoint; asynchronous: since the last exchange) at
  the healthy step time.
- audit: rows_lost counts metrics rows missing or logged twice (lock-step: every multiple of log_every up
  to the last checkpoint once; asynchronous, per process: no step twice, and the surviving incarnation's
  every multiple of log_every from its start to its last row); corrupt_states counts checkpoints that do
  not read back with valid checksums (io/checkpoint/read.py: digests and every replica's state checksum)
  and processes whose last evaluation is not finite or lies outside its peers' spread (asynchronous:
  not below the initial evaluation (step 0: a state reset to random weights or diverged), or outside
  [min − d, max + d] of the others' last evaluations, d = the larger of their range and 1 nat: processes
  at different progress differ by up to about 1 nat early in a run (seen: 3.90 against 2.92 at step 20
  on the smoke model), so only a gross fault is caught; a last evaluation of step 0 itself, a job that
  never saved a later step, is only checked finite; one that never evaluated nor saved at all, not at all). A last
  evaluation is the last one at or before that process's (job's) last checkpoint: the model that survived.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from experiments.lib import async_runs
from experiments.lib import harness
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import failures
from noloco_jax.runtime import launch_local

METHODS = ("async", "noloco", "diloco", "ddp")


def failure_trace(seed: int, processes: int, mtbf_s: float, horizon_s: float) -> list[tuple[float, int]]:
  """[(seconds from the origin, process)] sorted by time: each process a Poisson process of mean interval
  mtbf_s (math.inf: none), its draws from (seed, process) alone."""
  events = []
  if math.isinf(mtbf_s):
    return events
  for p in range(processes):
    rng = np.random.default_rng([seed, p, 38])
    t = 0.0
    while True:
      t += float(rng.exponential(mtbf_s))
      if t >= horizon_s:
        break
      events.append((t, p))
  return sorted(events)


@dataclasses.dataclass
class Setting:
  processes: int
  budget_s: float
  mtbf_s: float
  restart_delay_s: float
  step_s: float
  inner_steps: int
  checkpoint_every: int
  eval_every: int
  straggler: float  # the slow process's factor (process 0); 1: none
  seed: int
  max_wait_s: float
  lease_s: float
  exchange_timeout_s: float
  # JAX's persistent compilation cache of every process of every method (runtime/compile_cache.py), every
  # program written (threshold 0 s): a restarted process or job loads its programs instead of compiling
  # them again. "off": none (each restart compiles). "": the processes' default (~/.cache/noloco_jax/...).
  compile_cache: str = ""


def flags(method: str, workdir: str, s: Setting) -> list[str]:
  """The trainer's flags: the smoke model, one replica per process, a constant learning rate after warm-up
  (the job runs to a wall-clock budget, not to num_steps)."""
  out = ["--config=configs/default.py:smoke", f"--workdir={workdir}", f"--config.num_replicas={s.processes}",
         "--config.num_steps=1000000", f"--config.outer.inner_steps={s.inner_steps}", f"--config.seed={s.seed}",
         "--config.inner.min_lr_ratio=1.0", f"--config.log_every={s.inner_steps}",
         f"--config.eval_every={s.eval_every}", f"--config.checkpoint_every={s.checkpoint_every}"]
  if method == "async":
    return out + ["--config.outer.kind=noloco", "--config.outer.schedule=async",
                  f"--config.outer.asynchronous.max_wait_s={s.max_wait_s}",
                  f"--config.outer.asynchronous.lease_s={s.lease_s}", "--config.outer.asynchronous.join_timeout_s=60",
                  f"--config.outer.asynchronous.exchange_timeout_s={s.exchange_timeout_s}"]
  # One program for every round (bench_network.py's reason: a fresh pairing compiles every round, and P
  # compiles share this machine's cores).
  return out + [f"--config.outer.kind={method}"] + (["--config.outer.pairing=round_robin"] if method == "noloco" else [])


def device_time(s: Setting) -> str:
  """NOLOCO_FAULTS emulating device time: a sleep of step_s after every step, (factor − 1) × more on process 0."""
  spec = f"delay:seconds={s.step_s}"
  if s.straggler > 1:
    spec += f";delay:process=0,seconds={(s.straggler - 1) * s.step_s}"
  return spec


class _Procs:
  """The job's processes: one Popen per slot (asynchronous) or one launch_local.Job (lock-step)."""

  def __init__(self, method: str, workdir: str, s: Setting):
    self.method, self.workdir, self.s = method, workdir, s
    self.trace_dir = os.path.join(workdir, "trace")
    # A long heartbeat timeout: on a loaded machine a starting process can miss JAX's heartbeats for 30 s.
    self.env = {"NOLOCO_FAULTS": device_time(s), "NOLOCO_TRACE": self.trace_dir, "NOLOCO_HEARTBEAT_TIMEOUT_S": "120"}
    if s.compile_cache:
      self.env["NOLOCO_COMPILE_CACHE"] = s.compile_cache
      if s.compile_cache != "off":
        self.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    self.port = launch_local.free_port()
    self.service = None
    self.procs: list[subprocess.Popen | None] = [None] * s.processes
    self.started = [0.0] * s.processes  # when each slot's current process was started
    self.launches: list[tuple[float, list[int]]] = []  # (when, slots) of every start: `phases` reads them
    self.logs = os.path.join(workdir + "_logs")
    os.makedirs(self.logs, exist_ok=True)
    if method == "async":
      self.env["NOLOCO_STANDALONE_SERVICE"] = "1"
      self.service = subprocess.Popen([sys.executable, "-m", "noloco_jax.asynchronous.control", f"--port={self.port}",
                                       f"--num_processes={s.processes}", "--heartbeat_timeout_s=120"], cwd=harness.REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu"}, process_group=0)
      self.service.stdout.readline()  # "... coordination service for P processes ..." once it listens

  def start(self, slots) -> None:
    if self.method != "async":  # the whole job, one port per launch (the old service may linger)
      self.port = launch_local.free_port()
    self.launches.append((time.time(), list(slots)))
    for p in slots:
      self.started[p] = time.time()
      with open(os.path.join(self.logs, f"process_{p}.log"), "a") as log:
        self.procs[p] = subprocess.Popen(
            [sys.executable, "-m", "noloco_jax.main", *flags(self.method, self.workdir, self.s)], cwd=harness.REPO,
            env=launch_local.process_env(p, self.s.processes, 1, self.port, self.env), stdout=log,
            stderr=subprocess.STDOUT, process_group=0)

  def alive(self, p: int) -> bool:
    return self.procs[p] is not None and self.procs[p].poll() is None

  def kill(self, p: int) -> None:
    if self.alive(p):
      self.procs[p].send_signal(signal.SIGKILL)
      self.procs[p].wait()

  def stop(self, timeout_s: float = 120.0) -> list[int | None]:
    """SIGTERM to every process that has stepped since it (re)started (it saves and exits); SIGKILL to one
    still starting (it has nothing of its own to save, and may not read SIGTERM until it trains)."""
    traces = async_runs.read_traces(self.trace_dir, self.s.processes)
    stepped = lambda p: any(r["end"] > self.started[p] for r in traces[p])
    for p in range(self.s.processes):
      if self.alive(p):
        self.procs[p].send_signal(signal.SIGTERM if stepped(p) else signal.SIGKILL)
    end = time.time() + timeout_s
    while time.time() < end and any(self.alive(p) for p in range(self.s.processes)):
      time.sleep(0.2)
    for p in range(self.s.processes):
      self.kill(p)
    if self.service is not None:
      self.service.terminate()
      try:
        self.service.wait(timeout=30)
      except subprocess.TimeoutExpired:  # a loaded machine: it holds nothing, so it need not go quietly
        self.service.kill()
        self.service.wait()
    return [None if proc is None else proc.returncode for proc in self.procs]


def run(method: str, root: str, s: Setting, trace: list[tuple[float, int]], start_timeout_s: float = 600.0) -> dict:
  """One job under `trace` (module docstring); what `account` reads."""
  workdir = os.path.join(root, f"{method}_mtbf{s.mtbf_s:g}_s{s.seed}")
  shutil.rmtree(workdir, ignore_errors=True)
  procs = _Procs(method, workdir, s)
  lockstep = method != "async"
  procs.start(range(s.processes))
  deadline = time.time() + start_timeout_s
  origin = None
  while origin is None:
    if time.time() > deadline or not all(procs.alive(p) for p in range(s.processes)):
      procs.stop(10)
      raise RuntimeError(f"{method}: the job did not start (logs in {procs.logs})")
    time.sleep(0.2)
    origin = async_runs.origin(async_runs.read_traces(procs.trace_dir, s.processes))
  pending = list(trace)
  restarts: dict[int, float] = {}  # slot (lock-step: -1, the job) -> when it starts again
  kills = []  # {time, process, step, checkpoint, last_exchanged, skipped}
  skipped = 0
  end = origin + s.budget_s
  while time.time() < end:
    now = time.time()
    for key, when in sorted(restarts.items()):
      if now >= when:
        procs.start(range(s.processes) if key < 0 else [key])
        del restarts[key]
    while pending and origin + pending[0][0] <= now:
      _, p = pending.pop(0)
      down = (-1 in restarts) if lockstep else (p in restarts or not procs.alive(p))
      if down:
        skipped += 1
        continue
      kills.append(_kill(procs, p, lockstep, now))
      restarts[-1 if lockstep else p] = now + s.restart_delay_s
    time.sleep(0.05)
  codes = procs.stop()
  read = lambda path: metrics_lib.read_jsonl(path, missing_ok=True, skip_damaged=True)
  dirs = [workdir] if lockstep else [os.path.join(workdir, f"process_{p}") for p in range(s.processes)]
  return {"method": method, "workdir": workdir, "origin": origin, "end": end, "kills": kills, "skipped": skipped,
          "codes": codes, "launches": procs.launches, "logs": procs.logs, "traces": async_runs.read_traces(procs.trace_dir, s.processes),
          "rows": [read(os.path.join(d, "metrics.jsonl")) for d in dirs], "dirs": dirs}


def _kill(procs: _Procs, p: int, lockstep: bool, now: float) -> dict:
  """SIGKILLs process p (lock-step: then the whole job); what was lost, read at once."""
  procs.kill(p)  # first: what is read below is then final (a step could end between a read and the signal)
  traces = async_runs.read_traces(procs.trace_dir, procs.s.processes)
  record = {"time": now, "process": p, "step": max((r["step"] for r in traces[p]), default=0)}
  if lockstep:
    for q in range(procs.s.processes):
      procs.kill(q)
    record["checkpoint"] = failures.last_checkpoint(procs.workdir) or 0
  else:
    path = os.path.join(procs.workdir, f"process_{p}", f"pairings_{p}.jsonl")
    rows = metrics_lib.read_jsonl(path, missing_ok=True, skip_damaged=True)
    exchanged = [r["step"] for r in rows if r.get("status") == "exchanged"]
    record["last_exchanged"] = max(exchanged, default=0)
  return record


# ---- What is read from a job afterwards ----


def healthy_rate(run_: dict) -> float | None:
  """Steps per second per process before the run's first failure (every process's steps from the origin to
  the first kill, or to the end), None when that stretch is shorter than 5 s."""
  stop = min([k["time"] for k in run_["kills"]] + [run_["end"]])
  if stop - run_["origin"] < 5.0:
    return None
  steps = sum(1 for t in run_["traces"] for r in t if run_["origin"] < r["end"] <= stop)
  return steps / (len(run_["traces"]) * (stop - run_["origin"]))


def _cuts(run_: dict, p: int) -> list[float]:
  """Where slot p's trace is cut into incarnations, one time per kill: the slot's next launch after it (a
  step that ends between the kill's record and the signal is the old incarnation's; the new one steps only
  after its launch), the kill time for a run saved without its launches, inf when it was not started again."""
  kills = sorted(k["time"] for k in run_["kills"] if k["process"] == p)
  if "launches" not in run_:
    return kills
  return [min((t for t, who in run_["launches"] if t > k and p in who), default=math.inf) for k in kills]


def _segments(trace: list[dict], kill_times: list[float]) -> list[list[dict]]:
  """A process's trace rows cut into its incarnations at the given times (`_cuts`)."""
  out, bounds = [], sorted(kill_times) + [math.inf]
  rows = sorted(trace, key=lambda r: r["end"])
  lo = -math.inf
  for hi in bounds:
    out.append([r for r in rows if lo < r["end"] <= hi])
    lo = hi
  return out


def contributed_steps(run_: dict) -> tuple[int, list[dict]]:
  """(steps that reached the surviving model, per failure: the steps it lost); module docstring."""
  kills = run_["kills"]
  if run_["method"] != "async":
    # The last checkpoint, but no step past the budget (the final save, at SIGTERM, may hold a few more).
    done = min(max((r["step"] for r in t if r["end"] <= run_["end"]), default=0) for t in run_["traces"])
    final = min(failures.last_checkpoint(run_["workdir"]) or 0, done)
    lost = [{"steps": k["step"] - k["checkpoint"]} for k in kills]
    return final * len(run_["traces"]), lost
  total, lost = 0, []
  for p, trace in enumerate(run_["traces"]):
    mine = [k for k in kills if k["process"] == p]
    segments = _segments(trace, _cuts(run_, p))
    counted = 0  # the step up to which this slot's tokens are counted
    for i, seg in enumerate(segments):
      if not seg:
        continue
      start = seg[0]["step"] - 1
      in_budget = [r["step"] for r in seg if r["end"] <= run_["end"]]  # the surviving one: no step past the budget
      top = mine[i]["last_exchanged"] if i < len(mine) else max(in_budget, default=start)
      if i < len(mine):
        lost.append({"steps": max(mine[i]["step"] - top, 0)})
      total += max(top - max(start, counted), 0)
      counted = max(counted, top)
  return total, lost


def downtime(run_: dict) -> list[float]:
  """Per failure: seconds from the kill to the first step after it (of the job or of that process), or to
  the end of the budget."""
  out = []
  for k in run_["kills"]:
    traces = run_["traces"] if run_["method"] != "async" else [run_["traces"][k["process"]]]
    # From the relaunch on: a lock-step job's other processes (or the killed one) may end a step between
    # the kill's record and their signals, which is not the restarted job's.
    since = k["time"] if "launches" not in run_ else min(
        (t for t, who in run_["launches"] if t > k["time"] and (run_["method"] != "async" or k["process"] in who)),
        default=math.inf)
    after = [r["end"] for t in traces for r in t if r["end"] > since]
    out.append(min(min(after, default=run_["end"]), run_["end"]) - k["time"])
  return out


# Where a restart's time goes: the first line of each stage in the restarted process's log (absl's
# timestamps), in the order a restart passes them; a stage a restart does not pass (a fresh lock-step job
# restores nothing, a lock-step job joins no one) is absent from its record.
_STAGES = (("start_up", re.compile(r"main\.py:\d+\] Persistent compilation cache")),   # interpreter, imports, config
           ("init", re.compile(r"Start-up check: \d+ processes agree")),                 # control plane, data, state
           ("restore", re.compile(r"checkpoint: resumed from step")),                      # its own last checkpoint
           ("join", re.compile(r"joined the running job")),                                # a live peer's state
           ("compile", re.compile(r"Asynchronous rounds: \d+ programs compiled")))         # the rounds' programs
_STAMP = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")


def log_times(path: str, year: int) -> list[tuple[float, str]]:
  """(seconds since the epoch, line) of every absl-stamped line of a process's log (local time, as absl
  writes it)."""
  out = []
  if not os.path.exists(path):
    return out
  with open(path, errors="replace") as f:
    for line in f:
      if (m := _STAMP.match(line)):
        mon, day, hour, minute, sec = m.groups()
        t = time.mktime((year, int(mon), int(day), int(hour), int(minute), 0, 0, 0, -1)) + float(sec)
        out.append((t, line))
  return out


def phases(run_: dict) -> list[dict]:
  """Per failure whose restart trained again before the next failure and the budget's end: seconds from
  the kill to the restart's launch (`delay`, the supervisor's), then to the first line of each stage
  (_STAGES) the restarted process(es) passed (lock-step: the last process to pass it), then to the first
  step (`first_step`: lock-step, the step program's compile is in it). Needs the run's launches and logs."""
  if "launches" not in run_:
    return []
  lockstep = run_["method"] != "async"
  year = time.gmtime(run_["origin"]).tm_year
  logs = [log_times(os.path.join(run_["logs"], f"process_{p}.log"), year) for p in range(len(run_["traces"]))]
  out = []
  for k in run_["kills"]:
    slots = range(len(run_["traces"])) if lockstep else [k["process"]]
    kill_times = [j["time"] for j in run_["kills"] if lockstep or j["process"] == k["process"]]  # its own
    launch = min((t for t, who in run_["launches"] if t > k["time"] and (lockstep or k["process"] in who)), default=None)
    if launch is None:
      continue
    firsts = [min((r["end"] for r in run_["traces"][p] if r["end"] > launch), default=math.inf) for p in slots]
    first = min(firsts)
    if first > run_["end"] or any(launch < t < first for t in kill_times):
      continue
    record, last = {"delay": launch - k["time"]}, launch
    for name, pattern in _STAGES:
      seen = [min((t for t, line in logs[p] if launch <= t <= first and pattern.search(line)), default=None) for p in slots]
      if any(t is None for t in seen):
        continue
      record[name] = max(max(seen) - last, 0.0)
      last = max(last, max(seen))
    record["first_step"] = first - last
    out.append(record)
  return out


def partner_wait_s(run_: dict) -> float:
  """Asynchronous: seconds the processes waited for a partner in rounds that did not exchange (skipped or
  failed: mostly a dead or restarting partner's), summed over processes (each one's pairings log)."""
  if run_["method"] != "async":
    return 0.0
  total = 0.0
  for d in run_["dirs"]:
    slot = int(os.path.basename(d).rsplit("_", 1)[1])
    rows = metrics_lib.read_jsonl(os.path.join(d, f"pairings_{slot}.jsonl"), missing_ok=True, skip_damaged=True)
    total += sum(r.get("waited_s", 0.0) for r in rows if r.get("status") != "exchanged")
  return total


def audit_rows(run_: dict, log_every: int) -> int:
  """Rows missing or logged twice (module docstring)."""
  bad = 0
  for i, rows in enumerate(run_["rows"]):
    steps = [r["step"] for r in rows if "train/loss" in r]
    bad += len(steps) - len(set(steps))
    if run_["method"] != "async":
      top = failures.last_checkpoint(run_["workdir"]) or 0
      bad += len(set(range(log_every, top + 1, log_every)) - set(steps))
      continue
    last = _segments(run_["traces"][i], _cuts(run_, i))[-1]
    if last and steps:
      start, stop = last[0]["step"] - 1, max(steps)
      first = (start // log_every + 1) * log_every
      bad += len(set(range(first, stop + 1, log_every)) - set(steps))
  return bad


def audit_states(run_: dict) -> tuple[int, list[float]]:
  """(checkpoints that do not read back with valid checksums + processes whose last evaluation is not
  finite or outside its peers' spread, each process's last evaluation)."""
  from noloco_jax.io.checkpoint import read as read_lib  # pylint: disable=g-import-not-at-top
  bad = 0
  for d in run_["dirs"]:
    for step in read_lib.steps(d) if os.path.isdir(d) else ():
      try:
        read_lib.read(d, step)
      except Exception:  # pylint: disable=broad-except  (any failure to read it back is a corrupt checkpoint)
        bad += 1
  last, at_start, nothing = [], [], []
  for d, rows in zip(run_["dirs"], run_["rows"]):
    top = failures.last_checkpoint(d)
    evals = [r for r in rows if "eval/loss" in r and (top is None or r["step"] <= top)]
    last.append(evals[-1]["eval/loss"] if evals else math.nan)
    at_start.append(bool(evals) and evals[-1]["step"] == 0)
    nothing.append(not evals and top is None)  # killed before any evaluation and checkpoint: no model survived
  initial = [r["eval/loss"] for rows in run_["rows"] for r in rows if "eval/loss" in r and r["step"] == 0]
  for i, value in enumerate(last):
    others = [v for j, v in enumerate(last) if j != i and math.isfinite(v)]
    if nothing[i]:  # nothing to be corrupt (goodput's loss, not a fault)
      continue
    if at_start[i]:  # no trained model survived (a job that never saved past step 0): goodput's loss, not a fault
      bad += not math.isfinite(value)
    elif not math.isfinite(value) or (initial and value >= min(initial)):
      bad += 1
    elif others:
      d = max(max(others) - min(others), 1.0)
      bad += not (min(others) - d <= value <= max(others) + d)
  return bad, last


def account(run_: dict, s: Setting, healthy_s: float, tokens_per_step: int) -> dict:
  """The run's JSON record (bench_churn.py)."""
  steps, lost = contributed_steps(run_)
  down = downtime(run_)
  per_failure = [d + l["steps"] * healthy_s for d, l in zip(down, lost)]
  corrupt, last = audit_states(run_)
  stages = phases(run_)
  finite = [v for v in last if math.isfinite(v)]
  own = healthy_rate(run_)
  return {"method": run_["method"], "schedule": "async" if run_["method"] == "async" else "lockstep",
          "mtbf_s": s.mtbf_s, "seed": s.seed, "failures": len(run_["kills"]), "failures_skipped": run_["skipped"],
          "goodput": steps * tokens_per_step / (s.processes * s.budget_s * tokens_per_step / healthy_s),
          "goodput_own_pace": None if own is None else steps / (s.processes * s.budget_s * own),
          "healthy_step_s_own": None if own is None else 1.0 / own,
          "tokens": steps * tokens_per_step, "eval_loss_at_budget": float(np.mean(finite)) if finite else None,
          "time_lost_per_failure_s": float(np.mean(per_failure)) if per_failure else 0.0,
          "downtime_per_failure_s": float(np.mean(down)) if down else 0.0,
          "steps_lost_per_failure": float(np.mean([l["steps"] for l in lost])) if lost else 0.0,
          "phases_per_failure_s": {k: float(np.mean([p[k] for p in stages if k in p]))
                                    for k in ("delay", *(n for n, _ in _STAGES), "first_step") if any(k in p for p in stages)},
          "phases_counted": len(stages), "partner_wait_s": partner_wait_s(run_),
          "rows_lost": audit_rows(run_, s.inner_steps), "corrupt_states": corrupt, "exit_codes": run_["codes"]}
