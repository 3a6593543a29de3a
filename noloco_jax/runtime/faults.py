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
    stall:process=1,step=4,seconds=3             sleep 3 s once, after step 4 (the process stops; to
                                                 its peers much like a link down for 3 s, see linkdown)
    kill:process=1,step=5                        SIGKILL process 1 right after step 5 (a lost host)
    linkdown:process=1,step=4,seconds=2          drop every packet of process 1's TCP sockets for 2 s
                                                 from step 4 on while it keeps computing (a real
                                                 outage, tc on loopback: root, inside `unshare -n`;
                                                 runtime/link_faults.py)

`process=*` (or leaving `process` out) applies to every process. Nothing else reads the variable;
without it `after_step` does nothing, so a normal run carries no fault code on its path.

NOLOCO_TRACE=DIR (benchmarks: experiments/bench_network.py) also times every step: the loop's
hooks then wait for the state to be computed (so steps no longer overlap with the host) and append
{step, inner_s, round_s, slept_s} to DIR/trace_<process>.jsonl: inner_s from the end of the previous
step to the end of this inner step, round_s the outer round (its exchange and any wait for partners),
slept_s the injected delay; at a round step also program_wait_s (how long the round blocked on its
compiled program, outer/programs.py), compiles and compile_s (this process's compiles so far, their seconds).
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
KINDS = ("delay", "slowdown", "lognormal", "stall", "kill", "linkdown")


@dataclasses.dataclass
class Fault:
  kind: str
  process: int | None  # None: every process
  params: dict[str, float]


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
    try:
      values = {k: float(v) for k, v in params.items()}
      fault = Fault(kind, None if process == "*" else int(process), values)
    except ValueError:
      raise ValueError(f"{ENV}: {entry!r} has a value that is not a number.") from None
    need = {"delay": {"seconds"}, "slowdown": {"factor"}, "lognormal": {"median", "sigma"},
            "stall": {"step", "seconds"}, "kill": {"step"}, "linkdown": {"step", "seconds"}}[kind]
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
    self.faults = [f for f in faults if f.process in (None, process_index)]
    self._rngs = {id(f): np.random.default_rng(int(f.params.get("seed", 0)) + process_index)
                  for f in self.faults if f.kind == "lognormal"}
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
      if f.kind == "delay":
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
    """Tracing only: how long the round waited for its compiled program (outer/ahead.Stats), and the
    compiles so far, so that a benchmark can tell compile time from exchange and partner waits."""
    if self._trace is not None:
      self._program = {"program_wait_s": stats.waits_s[-1] if stats.waits_s else 0.0,
                       "compiles": stats.compiles, "compile_s": float(sum(stats.compile_s))}

  def after_step(self, step: int, state=None) -> None:
    if not self.faults and self._trace is None:
      return
    if self._trace is not None:
      _wait(state)
    now = time.perf_counter()
    inner_end = self._round_start or now
    seconds = self.delay_after(step, inner_end - self._last)
    if seconds > 0:
      time.sleep(seconds)
      self.slept_s += seconds
    if self._trace is not None:
      self._trace.write(json.dumps({"step": step, "inner_s": inner_end - self._last, "round_s": now - inner_end,
                                    "slept_s": seconds, "end": time.time(), **self._program}) + "\n")
    for f in self.faults:
      if f.kind == "linkdown" and step == int(f.params["step"]):
        self._links[id(f)].start()
      if f.kind == "kill" and step == int(f.params["step"]):
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no checkpoint: as if the host vanished
    self._round_start = None
    self._program = {}
    self._last = time.perf_counter()


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
