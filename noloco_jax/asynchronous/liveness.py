"""Who is alive: leases on heartbeat counters kept in the coordination service's store.

Why leases and not the runtime's own view: JAX's coordination service does detect a dead process
(after `heartbeat_timeout_s` without heartbeats), but the only way to ask it, `get_live_nodes` (what
`jax.live_devices` calls), is a barrier: it returns only once every live process it names has called
it (measured: it blocked 5 s while one of two processes slept 5 s, and 9.4 s, the heartbeat timeout,
when one of three had died). A process that trains at its own pace cannot wait for all the others to
ask who is alive, so liveness here is read from the store, which never waits for anybody.

The lease. Every process runs a daemon thread that writes `live/<slot>` = "<incarnation>:<counter>"
every `beat_s` seconds, the counter counting up. An observer remembers, by its own monotonic clock,
when it last saw each slot's value change; a slot whose value has not changed for `lease_s` seconds is
lost. A lost slot whose value moves again, same incarnation, has *returned*: it was stopped or starved
(SIGSTOP then SIGCONT, a swapped-out host), not dead, and is alive again: its state and its place in
the job are intact, so matchmaking groups it again (holding it out for good would leave it training
alone to its last step). Only the observer's clock is used, so the hosts' clocks need not agree. A
process that leaves normally writes "<incarnation>:left" and is gone at once. A restarted process (same slot, a new
incarnation from the runtime) is a new member: it joins, and an old incarnation still held alive is
lost at that moment. Detection takes between lease_s and
lease_s + the observer's polling interval (measured in tests/test_async_control.py and docs/async.md).

Why the thread keeps beating while the process computes: JAX dispatches programs asynchronously and
waits for results outside Python's GIL, so the heartbeat thread runs during the inner steps (the
tests' processes beat while they train). A lease says the process is running, not that it is making
progress; a process that is alive but never ready simply never pairs.

Every change an observer sees becomes an event {"time", "slot", "incarnation", "event"} with event one
of joined | left | lost | returned (and, of itself, left_behind: `beat`), kept in `events` and passed to `on_event` (logged per process).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from noloco_jax.asynchronous.control import KV

PREFIX = "live/"
LEFT = "left"


@dataclasses.dataclass
class _Seen:
  incarnation: int
  value: str
  changed_at: float  # observer's monotonic clock
  state: str  # alive | lost | left
  moved: bool = False  # its value has changed since this observer first saw this incarnation


class LeaseTable:
  """The observer's side, pure apart from the clock values it is given (tested with a fake clock)."""

  def __init__(self, me: int, lease_s: float):
    if lease_s <= 0:
      raise ValueError(f"lease_s={lease_s} is not valid: a number of seconds > 0.")
    self.me, self.lease_s = me, lease_s
    self._seen: dict[int, _Seen] = {}

  def observe(self, values: dict[int, str], now: float) -> list[dict]:
    """Takes the current `live/<slot>` values at time `now`; returns the events this observation implies."""
    events = []
    for slot, value in sorted(values.items()):
      inc_text, _, tail = value.partition(":")
      inc = int(inc_text)
      seen = self._seen.get(slot)
      if seen is None or seen.incarnation != inc:
        if seen is not None and seen.state == "alive":
          # Restarted before its old lease ran out: the old incarnation died without leaving.
          events.append(_event(slot, seen.incarnation, "lost"))
        state = LEFT if is_left(tail) else "alive"
        self._seen[slot] = _Seen(inc, value, now, state)
        if state == "alive":
          events.append(_event(slot, inc, "joined"))
        continue
      if value != seen.value:
        seen.value, seen.changed_at, seen.moved = value, now, True
        if is_left(tail):
          if seen.state != LEFT:
            seen.state = LEFT
            events.append(_event(slot, inc, "left"))
        elif seen.state == "lost":
          seen.state = "alive"
          events.append(_event(slot, inc, "returned"))
    for slot, seen in sorted(self._seen.items()):
      if slot != self.me and seen.state == "alive" and now - seen.changed_at > self.lease_s:
        seen.state = "lost"
        events.append(_event(slot, seen.incarnation, "lost"))
    return events

  def alive(self) -> dict[int, int]:
    """{slot: incarnation} of the members currently held alive (this process always is)."""
    return {s: v.incarnation for s, v in self._seen.items() if v.state == "alive" or s == self.me}

  def moving(self, now: float, within_s: float) -> dict[int, int]:
    """{slot: incarnation} of the others whose value this observer has seen change, the last time within
    `within_s` of `now` (a value seen once may be a dead process's last lease; one that moves is alive)."""
    return {s: v.incarnation for s, v in self._seen.items()
            if s != self.me and v.state != LEFT and v.moved and now - v.changed_at <= within_s}

  def silent_s(self, slot: int, now: float) -> float:
    """Seconds since `slot`'s lease value last changed, by this observer's clock (0 for itself, and for a slot
    never seen: a lease starts at first sight)."""
    seen = self._seen.get(slot)
    return 0.0 if seen is None or slot == self.me else now - seen.changed_at


def is_left(tail: str) -> bool:
  """Whether a lease value's part after the incarnation says "left" ("left", or "left:<counter>" from a
  process that left the schedule but keeps beating until it exits: Liveness.leave(keep_beating=True))."""
  return tail == LEFT or tail.startswith(LEFT + ":")


def _event(slot: int, incarnation: int, kind: str) -> dict:
  return {"time": time.time(), "slot": slot, "incarnation": incarnation, "event": kind}


class Liveness:
  """This process's heartbeat (a daemon thread) and its view of the others (`poll`)."""

  def __init__(self, kv: KV, slot: int, incarnation: int, *, beat_s: float = 0.5, lease_s: float = 10.0,
               on_event: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic,
               observe: bool = False):
    """`observe`: the heartbeat thread also reads every lease after each beat (`poll`), so that membership
    events are seen from the start, also while the process is busy starting up (a restart of a peer
    that happens then is still seen as that peer's loss and return)."""
    if not 0 < beat_s < lease_s:
      raise ValueError(f"beat_s={beat_s} is not valid with lease_s={lease_s}: need 0 < beat_s < lease_s "
                       "(a few beats per lease, so one late beat does not lose the lease).")
    self.kv, self.slot, self.incarnation = kv, slot, incarnation
    self.beat_s, self.lease_s, self._clock = beat_s, lease_s, clock
    self.table = LeaseTable(slot, lease_s)
    self.events: list[dict] = []
    self.on_event = on_event  # may be set later (the session's membership log)
    self._counter = 0
    self._last_beat: float | None = None  # its own clock at its last beat
    self._left = False  # left the schedule, still beating (leave(keep_beating=True))
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.RLock()  # poll's events are emitted under it (_emit takes it again)
    self._observe = observe
    self._first_poll: float | None = None  # its own clock at its first read of every lease

  def attach(self, on_event: Callable[[dict], None]) -> None:
    """From now on every event goes to `on_event`, the ones seen so far first (none is lost in between)."""
    with self._lock:
      for e in self.events:
        on_event(e)
      self.on_event = on_event

  def detach(self) -> None:
    """No more events to `on_event` (its log is closing); the lease goes on."""
    with self._lock:
      self.on_event = None

  def beat(self) -> None:
    """Renews this process's lease once. A gap since its last beat longer than the lease (by its own clock:
    the process was stopped, or its host paused) means the others have held it lost: it is told so by a
    `left_behind` event; its next beat makes it `returned` to them, and it is paired again."""
    now = self._clock()
    if self._last_beat is not None and now - self._last_beat > self.lease_s:
      self._emit([{**_event(self.slot, self.incarnation, "left_behind"), "silent_s": round(now - self._last_beat, 3)}])
    self._last_beat = now
    self._counter += 1
    tail = f"{LEFT}:{self._counter}" if self._left else str(self._counter)
    self.kv.set(f"{PREFIX}{self.slot}", f"{self.incarnation}:{tail}")

  def start(self) -> "Liveness":
    self.beat()
    self._thread = threading.Thread(target=self._run, name="noloco-heartbeat", daemon=True)
    self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stop.wait(self.beat_s):
      try:
        self.beat()
        if self._observe:
          self.poll()
      except Exception as e:  # pylint: disable=broad-except  (the service is gone: nothing left to renew)
        logging.warning("Heartbeat of slot %d stopped: %s", self.slot, str(e).splitlines()[0])
        return

  def leave(self, keep_beating: bool = False) -> None:
    """This process stops normally: the others see it gone at their next poll, not after a lease.

    `keep_beating`: it leaves the schedule (never grouped again) but goes on beating as "left:<counter>"
    until it exits, so that an observer can still tell a process finishing its run (saving, logging)
    from a dead one (the process hosting the service waits for the first, not the second: job.py).
    """
    if keep_beating:
      self._left = True
      self.beat()
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5 * self.beat_s)
    self.kv.set(f"{PREFIX}{self.slot}", f"{self.incarnation}:{LEFT}")

  def beating(self, wait_s: float | None = None) -> dict[int, int]:
    """{slot: incarnation} of the others whose heartbeat moves within `wait_s` (default 3 beats).

    For a process that has just started: its first poll holds every slot alive (a lease starts at
    first sight), a dead one included until a lease has passed; a beat that moves proves life now.
    Observing from start-up (`observe`), the heartbeat thread has been reading every lease since: only
    what is left of `wait_s` since its first read is waited (a restarted process asks after its
    start-up and restore, so little is left: under churn at P = 8 a join took 0.95 s, against 1.29 s
    sleeping the whole wait; experiments/RESULTS.md, "Goodput under churn").
    """
    wait_s = 3 * self.beat_s if wait_s is None else wait_s
    if self._observe:
      self.poll()
      time.sleep(max(0.0, wait_s - (self._clock() - self._first_poll)))
      with self._lock:
        self.poll()
        return self.table.moving(self._clock(), wait_s)
    before = self.kv.dir(PREFIX)
    time.sleep(wait_s)
    after = self.kv.dir(PREFIX)
    moved = {}
    for key, value in after.items():
      slot = int(key[len(PREFIX):])
      inc, _, tail = value.partition(":")
      if slot != self.slot and not is_left(tail) and before.get(key) != value:
        moved[slot] = int(inc)
    self.poll()
    return moved

  def poll(self) -> dict[int, int]:
    """Reads every lease once (one store call); returns {slot: incarnation} of the live members."""
    raw = self.kv.dir(PREFIX)
    values = {int(k[len(PREFIX):]): v for k, v in raw.items()}
    with self._lock:
      if self._first_poll is None:
        self._first_poll = self._clock()
      self._emit(self.table.observe(values, self._clock()))
      return self.table.alive()

  def silent_past(self, slot: int, bound_s: float) -> float | None:
    """How long `slot`'s heartbeat has not moved, if longer than `bound_s`, else None (reads every lease
    first: one store call). What an exchange or a batch waiting on a partner asks (transport.py,
    matchmaking.py: outer.asynchronous.partner_silence_s), so that a stopped partner costs its peers
    about `bound_s`, not a whole timeout. A partner that is only slow is not silent: its heartbeat is this
    daemon thread, which beats while the process computes, compiles or saves (module docstring); a host so
    starved that the thread cannot run for `bound_s` is taken for stopped. And the answer is as fresh as
    this read: an observer that was itself stopped sees the values that moved meanwhile as moved now."""
    with self._lock:
      self.poll()
      silent = self.table.silent_s(slot, self._clock())
    return silent if silent > bound_s else None

  def _emit(self, events: list[dict]) -> None:
    with self._lock:
      for e in events:
        self.events.append(e)
        logging.info("Membership: slot %d (incarnation %d) %s.", e["slot"], e["incarnation"], e["event"])
        if self.on_event is not None:
          self.on_event(e)
