"""Compile ahead: build the program of a future outer round on a background thread, off the critical path.

With `outer.pairing = "fresh"` on a mesh, every round's grouping needs its own program (`ppermute` takes
its routing at trace time). For a method given in parts (NoLoCo, gossip) that program holds the round's
routes alone (outer/rounds.py); the rest of the round is compiled once. The grouping of round t+1 is a
pure function of (seed, t+1), known long before it is needed, so the loop asks for it right after round
t and it is lowered and compiled (`jit(...).lower(...).compile()`, JAX's ahead-of-time API) while round
t+1's H inner steps run. At the round boundary the program is normally ready: the loop only waits if
the compile took longer than the inner steps (the wait is recorded: `stats`, and
experiments/bench_pairing.py measures it). Nothing is announced past the run's last round
(`RoundPrograms(last_round=...)`), so the end of a run neither compiles nor waits for a round that
never runs.

Every process compiles the same programs from the same (seed, round), so a multi-process job stays in
step without talking. Programs are kept in a small LRU cache (`capacity`, default 4: the current and
the next round's, plus slack, besides the programs every round runs), so a long run does not
accumulate thousands of executables; with a pooled or single-device program every round has the same
key and it is compiled once.

XLA compiles with the GIL released, so the main thread keeps dispatching inner steps; the tracing and
lowering part holds the GIL for a few milliseconds per program.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable, Hashable

import jax
import numpy as np


@dataclasses.dataclass
class Stats:
  compiles: int = 0  # programs compiled (background or inline)
  compile_s: list = dataclasses.field(default_factory=list)  # seconds each compile took (lower + compile)
  waits_s: list = dataclasses.field(default_factory=list)  # seconds each `get` blocked the caller
  hits: int = 0  # `get`s whose program was already compiled
  keys: list = dataclasses.field(default_factory=list)  # the key of each compile, in the order of compile_s


class AheadCompiler:
  """key -> compiled program, compiled in the background when announced with `prefetch`."""

  def __init__(self, lower: Callable[[Hashable], Any], capacity: int = 4):
    """`lower(key)` returns the program lowered for its abstract arguments (`jit(f).lower(*structs)`)."""
    if capacity < 2:
      raise ValueError(f"capacity={capacity} must be ≥ 2 (the current and the next program).")
    self._lower, self._capacity = lower, capacity
    self._futures: collections.OrderedDict[Hashable, concurrent.futures.Future] = collections.OrderedDict()
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahead-compile")
    self._lock = threading.Lock()
    self.stats = Stats()

  def _compile(self, key: Hashable) -> Any:
    # Evict here, on the worker: dropping the last reference to an executable destroys it, which can
    # take tens of milliseconds (measured: up to 0.16 s on a loaded CPU) that the caller must not wait.
    with self._lock:
      evicted = self._evict()
    del evicted
    start = time.perf_counter()
    compiled = self._lower(key).compile()
    with self._lock:
      self.stats.compiles += 1
      self.stats.compile_s.append(time.perf_counter() - start)
      self.stats.keys.append(key)
    return compiled

  def _evict(self) -> list:
    """Removes least recently used compiled entries beyond capacity; returns them (the caller drops them)."""
    evicted = []
    while len(self._futures) > self._capacity:
      for key, future in self._futures.items():
        if future.done():
          evicted.append(self._futures.pop(key))
          break
      else:  # every entry is still compiling (cannot happen with one worker and capacity ≥ 2)
        break
    return evicted

  def prefetch(self, key: Hashable) -> None:
    """Starts compiling `key`'s program in the background, unless it is cached or under way."""
    with self._lock:
      if key in self._futures:
        self._futures.move_to_end(key)
        return
      self._futures[key] = self._executor.submit(self._compile, key)

  def get(self, key: Hashable) -> Any:
    """The compiled program of `key`: cached, else waits for its compile (started now if never announced)."""
    return self.get_all((key,))[0]

  def get_all(self, keys: tuple) -> list:
    """The compiled programs of `keys`, waited for together: the time the caller blocked is recorded
    as one wait (a round that needs several programs waits once)."""
    futures, ready = [], True
    for key in keys:
      self.prefetch(key)
      with self._lock:
        future = self._futures[key]
        self._futures.move_to_end(key)
        ready = ready and future.done()
      futures.append(future)
    start = time.perf_counter()
    compiled = [future.result() for future in futures]  # re-raises a compile error here, on the caller's thread
    with self._lock:
      self.stats.waits_s.append(0.0 if ready else time.perf_counter() - start)
      self.stats.hits += ready
    return compiled

  def __len__(self) -> int:
    """Programs held: at most capacity + 1 (the newest is added before the worker evicts)."""
    return len(self._futures)

  def close(self) -> None:
    self._executor.shutdown(wait=True, cancel_futures=True)


class RoundPrograms:
  """The compiled program(s) and the route of each outer round, the round's own compiled one round ahead.

  `plan(round)` gives (program key, route) (outer/rounds.Rounds.plan); `lower(key)` the program of a
  key lowered for its abstract arguments (`jit(...).lower(...)`; outer/rounds.py builds them).
  `fixed`: keys of programs that every round runs besides its own (a round in parts: its message and
  merge), compiled in the background from the start and kept; `compose(*fixed programs, round's
  program)` then makes the round function. `last_round`: the run's last round (None: no end), past
  which nothing is announced. `compile_ahead=False` announces nothing: each round's program compiles when
  the round asks for it, on the caller's critical path (what experiments/bench_pairing.py compares with).
  """

  def __init__(self, plan: Callable[[int], tuple[Hashable, np.ndarray]], lower: Callable[[Hashable], Any],
               capacity: int = 4, *, fixed: tuple = (), compose: Callable | None = None, last_round: int | None = None,
               compile_ahead: bool = True):
    self._plan, self._fixed, self._compose, self._last = plan, tuple(fixed), compose, last_round
    self._ahead = compile_ahead
    self.compiler = AheadCompiler(lower, capacity=capacity + len(self._fixed))
    for key in self._fixed:
      self.compiler.prefetch(key)

  def prefetch(self, round_: int) -> None:
    """Announces round `round_`: its program compiles in the background if it is not cached (nothing
    past the last round)."""
    if self._ahead and (self._last is None or round_ <= self._last):
      self.compiler.prefetch(self._plan(round_)[0])

  def program(self, round_: int) -> tuple[Callable, np.ndarray]:
    """(compiled round function, route) for round `round_`; announces round_ + 1 before returning."""
    key, route = self._plan(round_)
    compiled = self.compiler.get_all((*self._fixed, key))
    self.prefetch(round_ + 1)
    return (self._compose(*compiled) if self._compose is not None else compiled[-1]), route

  def close(self) -> None:
    self.compiler.close()
