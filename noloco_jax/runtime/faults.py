"""Deterministic fault injection for tests and benchmarks: slow, stalled or killed processes.

The training loop calls `after_step(step)` once per inner step (noloco_jax/training/loop.py). Faults
come from the environment variable NOLOCO_FAULTS, a `;`-separated list of `kind:key=value,...`:

    delay:process=1,seconds=0.2                  sleep 0.2 s after every step on process 1
    slowdown:process=1,factor=2                  sleep (factor − 1) × the step's own time: 2× slower
                                                 (the step's time as the host sees it: only with
                                                 NOLOCO_TRACE is that its compute, see below)
    lognormal:process=*,median=0.05,sigma=0.5,seed=0
                                                 sleep a log-normal time after every step; the draws of
                                                 process p come from seed + p, so they are reproducible
    pace:seconds=0.1                             emulated device time: every step takes at least 0.1 s
                                                 (sleep 0.1 s less the step's own compute, which is
                                                 waited for); `sigma=0.5,seed=0`: a log-normal time of
                                                 median `seconds` per step instead, drawn as lognormal's;
                                                 an entry naming the process wins over process=*
    stall:process=1,step=4,seconds=3             sleep 3 s once, after step 4 (the process stops; to
                                                 its peers much like a link down for 3 s, see linkdown)
    kill:process=1,step=5                        SIGKILL process 1 right after step 5 (a lost host)
    linkdown:process=1,step=4,seconds=2          drop every packet of process 1's TCP sockets for 2 s
                                                 from step 4 on while it keeps computing (a real
                                                 outage, tc on loopback: root, inside `unshare -n`;
                                                 runtime/link_faults.py)

`process=*` (or leaving `process` out) applies to every process. Nothing else reads the variable;
without it `after_step` does nothing, so a normal run carries no fault code on its path.

Faults inside an exchange of the asynchronous schedule (asynchronous/transport.py calls `ExchangeFaults.at`
at three points of each exchange, asynchronous/matchmaking.py at one point of the pairing before it;
`round=k`: the process's k-th exchange since it started):

    xkill:process=1,round=3,at=announced         SIGKILL itself at that point (a host lost mid-transfer)
    xstop:process=1,round=3,at=offered,seconds=8 SIGSTOP itself (every thread, its heartbeat and transfer
                                                 server too) for 8 s; a helper process sends SIGCONT
    xdelay:process=1,round=3,at=offered,seconds=4
                                                 sleep 4 s there (alive but late: its partner's transfer
                                                 times out)
    xclock:process=1,round=3,at=offered,seconds=-3600
                                                 step its wall clock by −3600 s (libfaketime: the process
                                                 must run with it preloaded and FAKETIME_TIMESTAMP_FILE set;
                                                 the fault writes the offset there)

`at`: `ticketed` (pairing for its k-th exchange: its ticket is in the store, its batch not yet closed;
once, at its first ticket), `offered` (its message is on its transfer server, its partners not yet
told), `announced` (its store entry is written: partners pull from it now), `pulled` (it holds its
partners' messages, before it returns them). A stop or a delay past the exchange's deadline, or past the lease, is what the tests of
issue 38 place (tests/test_async_exchange_faults.py).

NOLOCO_TRACE=DIR (benchmarks: experiments/bench_network.py) also times every step: the loop's
hooks then wait for the state to be computed (so steps no longer overlap with the host) and append
{step, inner_s, round_s, slept_s} to DIR/trace_<process>.jsonl: inner_s from the end of the previous
step to the end of this inner step, round_s the outer round (its exchange and any wait for partners),
slept_s the injected delay (with `pace` also device_s, the step's emulated device time); at a round step
also program_wait_s (how long the round blocked on its compiled program, outer/programs.py), compiles and
compile_s (this process's compiles so far, their seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import numpy as np

from noloco_jax.runtime import failures
from noloco_jax.runtime import link_faults

ENV = "NOLOCO_FAULTS"
TRACE_ENV = "NOLOCO_TRACE"
KINDS = ("delay", "slowdown", "lognormal", "pace", "stall", "kill", "linkdown", "xkill", "xstop", "xdelay", "xclock")
EXCHANGE_KINDS = ("xkill", "xstop", "xdelay", "xclock")
# The points where the hook is called: matchmaking.py's (before the exchange), then transport.py's.
PHASES = ("ticketed", "offered", "announced", "pulled")


@dataclasses.dataclass
class Fault:
  kind: str
  process: int | None  # None: every process
  params: dict[str, float]
  at: str | None = None  # exchange faults: the point of the exchange (PHASES)


def parse(spec: str) -> list[Fault]:
  """Faults of a NOLOCO_FAULTS string; a bad entry is one clear error naming it."""
  faults = []
  for entry in filter(None, (e.strip() for e in spec.split(";"))):
    kind, _, args = entry.partition(":")
    if kind not in KINDS:
      raise ValueError(f"{ENV}: fault kind {kind!r} in {entry!r} is not valid (valid: {', '.join(KINDS)}).")
    params: dict[str, float] = {}
    for pair in filter(None, args.split(",")):
      key, sep, value = pair.partition("=")
      if not sep:
        raise ValueError(f"{ENV}: {pair!r} in {entry!r} is not key=value.")
      params[key.strip()] = value.strip()
    process = params.pop("process", "*")
    at = params.pop("at", None)
    if (at is not None) != (kind in EXCHANGE_KINDS) or (at is not None and at not in PHASES):
      raise ValueError(f"{ENV}: {entry!r}: at={at} is not valid" + (f" (valid: {', '.join(PHASES)})." if kind in
                       EXCHANGE_KINDS else f" ({kind} applies after a step; at= is for {', '.join(EXCHANGE_KINDS)})."))
    try:
      values = {k: float(v) for k, v in params.items()}
      fault = Fault(kind, None if process == "*" else int(process), values, at)
    except ValueError:
      raise ValueError(f"{ENV}: {entry!r} has a value that is not a number.") from None
    need = {"delay": {"seconds"}, "slowdown": {"factor"}, "lognormal": {"median", "sigma"}, "pace": {"seconds"},
            "stall": {"step", "seconds"}, "kill": {"step"}, "linkdown": {"step", "seconds"},
            "xkill": {"round"}, "xstop": {"round", "seconds"}, "xdelay": {"round", "seconds"},
            "xclock": {"round", "seconds"}}[kind]
    if need - values.keys():
      raise ValueError(f"{ENV}: {entry!r} needs {sorted(need)}.")
    faults.append(fault)
  return faults


class Injector:
  """Applies the faults that name this process after each step."""

  def __init__(self, faults: list[Fault], process_index: int, trace_dir: str | None = None):
    self._trace = None
    if trace_dir:
      os.makedirs(trace_dir, exist_ok=True)
      self._trace = open(os.path.join(trace_dir, f"trace_{process_index}.jsonl"), "a", buffering=1)
    self._round_start = None
    self._program = {}  # tracing: the current round's program wait and compile counts (after_program)
    self.faults = [f for f in faults if f.process in (None, process_index) and f.kind not in EXCHANGE_KINDS]
    paces = [f for f in self.faults if f.kind == "pace"]
    named = [f for f in paces if f.process is not None]
    self.faults = [f for f in self.faults if f.kind != "pace"] + (named or paces)[-1:]  # one pace: the most specific
    self._rngs = {id(f): np.random.default_rng(int(f.params.get("seed", 0)) + process_index)
                  for f in self.faults if f.kind in ("lognormal", "pace")}
    self._pace = next((f for f in self.faults if f.kind == "pace"), None)
    self.device_s = None  # the last step's emulated device time (pace), for its trace row
    self._links = {}
    for f in self.faults:
      if f.kind == "linkdown":  # refused now, in one line, rather than at step k
        reason = link_faults.unavailable_reason()
        if reason:
          raise failures.ReportedError(f"{ENV}: linkdown {reason}.")  # one line, no traceback (main.py)
        self._links[id(f)] = link_faults.LinkDown(f.params["seconds"], pref=1000 + 2 * process_index)
    self._last = time.perf_counter()
    self.slept_s = 0.0  # injected seconds so far (benchmarks subtract or report it)

  @property
  def tracing(self) -> bool:
    return self._trace is not None

  def delay_after(self, step: int, step_s: float) -> float:
    """Seconds to sleep after `step`, which took `step_s` (pure apart from the seeded draws)."""
    total = 0.0
    for f in self.faults:
      p = f.params
      if f.kind == "pace":
        self.device_s = p["seconds"] * (float(np.exp(p["sigma"] * self._rngs[id(f)].standard_normal()))
                                        if p.get("sigma") else 1.0)
        total += max(self.device_s - step_s, 0.0)
      elif f.kind == "delay":
        total += p["seconds"]
      elif f.kind == "slowdown":
        total += max(p["factor"] - 1.0, 0.0) * step_s
      elif f.kind == "lognormal":
        total += float(p["median"] * np.exp(p["sigma"] * self._rngs[id(f)].standard_normal()))
      elif f.kind == "stall" and step == int(p["step"]):
        total += p["seconds"]
    return total

  def before_round(self, state) -> None:
    """Tracing only: the inner step's end (waited for), the round's start."""
    if self._trace is not None:
      _wait(state)
      self._round_start = time.perf_counter()

  def after_program(self, stats) -> None:
    """Tracing only: how long the round waited for its compiled program (outer/programs.Stats), and the
    compiles so far, so that a benchmark can tell compile time from exchange and partner waits."""
    if self._trace is not None:
      self._program = {"program_wait_s": stats.waits_s[-1] if stats.waits_s else 0.0,
                       "compiles": stats.compiles, "compile_s": float(sum(stats.compile_s))}

  def after_step(self, step: int, state=None) -> None:
    if not self.faults and self._trace is None:
      return
    if self._trace is not None or self._pace is not None:  # pace needs the step's compute, done
      _wait(state)
    now = time.perf_counter()
    inner_end = self._round_start or now
    seconds = self.delay_after(step, inner_end - self._last)
    if seconds > 0:
      time.sleep(seconds)
      self.slept_s += seconds
    if self._trace is not None:
      self._trace.write(json.dumps({"step": step, "inner_s": inner_end - self._last, "round_s": now - inner_end,
                                    "slept_s": seconds, "end": time.time(), **self._program,
                                    **({"device_s": self.device_s} if self._pace else {})}) + "\n")
    for f in self.faults:
      if f.kind == "linkdown" and step == int(f.params["step"]):
        self._links[id(f)].start()
      if f.kind == "kill" and step == int(f.params["step"]):
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no checkpoint: as if the host vanished
    self._round_start = None
    self._program = {}
    self._last = time.perf_counter()


class ExchangeFaults:
  """The exchange faults (x*) that name this process; `at(phase)` is called by transport.py inside every
  exchange, `begin()` once at its start (it counts the rounds)."""

  def __init__(self, faults: list[Fault], process_index: int):
    self.faults = [f for f in faults if f.process in (None, process_index) and f.kind in EXCHANGE_KINDS]
    self.round = 0
    self._fired: set[int] = set()  # each fault once (a round's pairing may take several tickets)

  def begin(self) -> None:
    self.round += 1

  def at(self, phase: str) -> None:
    for f in self.faults:
      # `ticketed` comes before the exchange's begin(): it belongs to the coming round.
      round_now = self.round + 1 if phase == "ticketed" else self.round
      if f.at != phase or int(f.params["round"]) != round_now or id(f) in self._fired:
        continue
      self._fired.add(id(f))
      seconds = f.params.get("seconds", 0.0)
      if f.kind == "xkill":
        os.kill(os.getpid(), signal.SIGKILL)
      elif f.kind == "xstop":
        # Nothing inside a stopped process runs, so another process ends the stop.
        import subprocess  # pylint: disable=g-import-not-at-top
        subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
      elif f.kind == "xdelay":
        time.sleep(seconds)
      elif f.kind == "xclock":
        path = os.environ.get("FAKETIME_TIMESTAMP_FILE")
        if not path or "faketime" not in os.environ.get("LD_PRELOAD", ""):
          raise failures.ReportedError(f"{ENV}: xclock needs libfaketime preloaded (LD_PRELOAD) and "
                                       "FAKETIME_TIMESTAMP_FILE set; this process has neither.")
        with open(path, "w") as out:
          out.write(f"{seconds:+.0f}\n")


def exchange_from_env(process_index: int) -> ExchangeFaults | None:
  """The exchange faults of this process from NOLOCO_FAULTS; None when it names none (the exchange then
  carries no fault code on its path)."""
  hook = ExchangeFaults(parse(os.environ.get(ENV, "")), process_index) if os.environ.get(ENV) else None
  return hook if hook is not None and hook.faults else None


def from_env(process_index: int | None = None) -> Injector | None:
  """The injector for this process from NOLOCO_FAULTS and NOLOCO_TRACE; None when neither is set (a normal
  run then carries no fault code on its path)."""
  if not os.environ.get(ENV) and not os.environ.get(TRACE_ENV):
    return None
  if process_index is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index = jax.process_index()
  return Injector(parse(os.environ.get(ENV, "")), process_index, os.environ.get(TRACE_ENV))


def _wait(state) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(state)
