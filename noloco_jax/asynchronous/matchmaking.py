"""Matchmaking: the pairing law of law.py as a protocol over the coordination service's store.

A process whose replicas finished their H inner steps calls `Matchmaker.ready(progress)`; it returns
the group it exchanges with this round (a `Match`), or None when no partner came within the budget
(`max_wait_s`): the round's exchange is skipped, never waited for.

The protocol uses only the store's atomic operations (control.py), no process is in charge, and a
process that dies at any point delays nobody for more than a bounded time:

- Ticket. `increment("mm/ticket")` gives the caller a unique, totally ordered ticket n; it then
  writes `mm/t/<n>` = {slot, incarnation, progress}.
- Batches. Batch b holds the tickets (last_{b−1}, last_b]. Its record `mm/b/<b>` is *created* (insert
  if absent) by whoever closes it: normally its opener (the holder of ticket last_{b−1} + 1), or, when
  the opener is dead or stalled, any member after `close_grace_s` more. The store lets exactly one
  creator win, so every process reads the same record. A closer reads the counter (that is last_b),
  the members' ticket entries, drops members whose lease is not held (liveness.py) and keeps one ticket
  per slot, and draws the groups with law.draw_groups(seed, b). Each process keeps a cursor (the next
  batch it has not read and the last ticket before it), so finding one's batch costs a read or two.
- Waiting without polling. An opener blocks on the store for the *next* ticket's entry (`wait`), so it
  wakes when someone arrives, when the window ends, or at its deadline; members block on the record.
- Left out (odd="leave_out", or alone at the deadline): a new ticket while the budget lasts.
- A silent process (`silent`: its heartbeat has not moved for outer.asynchronous.partner_silence_s,
  liveness.Liveness.silent_past; stopped, though its lease still holds) is left out by a closer, and a
  member stops waiting for a silent opener's close at once and closes the batch itself.

A process's wait for a partner is bounded by max_wait_s + window_s + close_grace_s (+ store calls):
an opener waits at most max_wait_s; a member, whose arrival gives the batch two members, waits at
most window_s for a live opener's close and close_grace_s more for a stalled or dead one's (with
`silent`, no longer than the silence bound + check_s for a silent one's).

`mm/latest` ("b:last", overwritten by closers) lets a starting or restarted process find the current
batch; the closer of batch b deletes the record and ticket entries of batch b − keep_batches.

Fragment streaming (`fragment` = f): fragment f's rounds are matched among the processes ready for that
fragment only, under keys of their own (`mm/f<f>/...`), their batches counted and drawn apart.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Callable, Mapping

from noloco_jax.asynchronous import law
from noloco_jax.asynchronous.control import KV

TICKET = "mm/ticket"
LATEST = "mm/latest"


def _ticket_key(n: int) -> str:
  return f"mm/t/{n}"


def _batch_key(b: int) -> str:
  return f"mm/b/{b}"


@dataclasses.dataclass(frozen=True)
class Member:
  slot: int
  incarnation: int
  progress: int  # inner steps its replicas have taken (the staleness rule's unit; outer/async_rules.py)
  ticket: int


@dataclasses.dataclass(frozen=True)
class Match:
  """This process's group in batch `batch` (itself included, sorted by slot)."""
  batch: int
  me: int
  group: tuple[Member, ...]
  waited_s: float
  tickets: int  # tickets taken this round (1 + re-entries after being left out)

  @property
  def partners(self) -> tuple[Member, ...]:
    return tuple(m for m in self.group if m.slot != self.me)

  @property
  def own(self) -> Member:
    return next(m for m in self.group if m.slot == self.me)


@dataclasses.dataclass
class Stats:
  rounds: int = 0
  matched: int = 0
  skipped: int = 0
  tickets: int = 0
  batches_closed: int = 0  # records this process created
  fallback_closes: int = 0  # of which as a member whose opener did not close in time
  wait_s: float = 0.0  # total time between ready() and its answer

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class Matchmaker:
  """One process's side of the protocol (module docstring)."""

  def __init__(self, kv: KV, slot: int, incarnation: int, *, seed: int, window_s: float, max_wait_s: float,
               live: Callable[[], Mapping[int, int]], odd: str = "triple", close_grace_s: float = 5.0,
               ticket_grace_s: float = 2.0, keep_batches: int = 64, clock: Callable[[], float] = time.monotonic,
               silent: Callable[[int], float | None] | None = None, check_s: float = 0.25, hook=None,
               fragment: int | None = None):
    """`silent(slot)`: how long that process's heartbeat has been silent, when past the bound
    (liveness.Liveness.silent_past), else None; a member asks it of a batch's opener every `check_s`
    while it waits for the close, and a closer leaves out every member it names (module docstring). `hook`:
    faults placed in its pairing (runtime/faults.ExchangeFaults, `at=ticketed`; tests and benchmarks)."""
    if window_s < 0:
      raise ValueError(f"window_s={window_s} is not valid: a number of seconds ≥ 0.")
    if max_wait_s <= 0:
      raise ValueError(f"max_wait_s={max_wait_s} is not valid: a number of seconds > 0.")
    if odd not in law.ODD_RULES:
      raise ValueError(f"odd={odd!r} is not valid; choose one of {law.ODD_RULES}.")
    self.kv, self.slot, self.incarnation, self.seed = kv, slot, incarnation, seed
    self.window_s, self.max_wait_s, self.odd = window_s, max_wait_s, odd
    self.close_grace_s, self.ticket_grace_s, self.keep_batches = close_grace_s, ticket_grace_s, keep_batches
    self._live, self._clock, self._silent, self.check_s, self.hook = live, clock, silent, check_s, hook
    self.fragment = fragment
    # Fragment f's protocol under keys of its own (module docstring); without fragments, the keys above.
    scoped = (lambda key: key) if fragment is None else (lambda key: f"mm/f{fragment}/{key[len('mm/'):]}")
    self._ticket, self._latest = scoped(TICKET), scoped(LATEST)
    self._ticket_key = lambda n: scoped(_ticket_key(n))
    self._batch_key = lambda b: scoped(_batch_key(b))
    self._batch, self._last = 0, 0  # cursor: the first batch not yet read, the last ticket before it
    self.stats = Stats()
    self.history: collections.deque[dict] = collections.deque(maxlen=1000)  # the last rounds' outcomes

  # ---- The call the driver makes ----

  def ready(self, progress: int) -> Match | None:
    """Blocks until this process has a group for this round (a Match) or its budget ran out (None)."""
    start = self._clock()
    deadline = start + self.max_wait_s
    self._refresh_cursor()
    tickets = 0
    match = None
    while True:
      ticket = self.kv.increment(self._ticket, 1)
      tickets += 1
      self.kv.set(self._ticket_key(ticket), json.dumps([self.slot, self.incarnation, int(progress)]))
      if self.hook is not None:
        self.hook.at("ticketed")
      record = self._find_batch(ticket, deadline)
      group = _group_of(record, ticket, self.slot)
      if group is not None:
        match = Match(record["b"], self.slot, group, self._clock() - start, tickets)
        break
      if self._clock() >= deadline:
        break
    waited = self._clock() - start
    self.stats.rounds += 1
    self.stats.tickets += tickets
    self.stats.wait_s += waited
    if match is None:
      self.stats.skipped += 1
      logging.info("Matchmaking: slot %d found no partner within %.3g s (%d tickets); the exchange is skipped.",
                   self.slot, self.max_wait_s, tickets)
    else:
      self.stats.matched += 1
    self.history.append({"progress": int(progress), "batch": None if match is None else match.batch,
                         "group": None if match is None else [m.slot for m in match.group],
                         "waited_s": waited, "tickets": tickets})
    return match

  # ---- Finding and closing batches ----

  def _refresh_cursor(self) -> None:
    hint = self.kv.get(self._latest)
    if hint:
      b, last = (int(x) for x in hint.split(":"))
      if b >= self._batch:
        self._batch, self._last = b + 1, last

  def _find_batch(self, ticket: int, deadline: float) -> dict:
    """The record of the batch holding `ticket`, walking the cursor forward (closing it if ours to close)."""
    while True:
      raw = self.kv.get(self._batch_key(self._batch))
      if raw is None:
        if ticket == self._last + 1:
          record = self._open(self._batch, ticket, deadline)
        else:
          record = self._await(self._batch, deadline)
      else:
        record = json.loads(raw)
      self._batch, self._last = record["b"] + 1, record["last"]
      if ticket <= record["last"]:
        return record

  def _open(self, b: int, ticket: int, deadline: float) -> dict:
    """As the opener of batch b: waits for arrivals until law.should_close, then closes it."""
    opened_at = self._clock()
    live_count = len(self._live())
    highest = ticket
    while True:
      now = self._clock()
      count = highest - ticket + 1
      if law.should_close(now, opened_at, count, live_count, self.window_s, deadline):
        break
      # Wake at the next arrival, or when the rule could next change its answer: the window's end
      # (with a partner already here) or the deadline.
      until = deadline if count < 2 else min(opened_at + self.window_s, deadline)
      if self.kv.wait(self._ticket_key(highest + 1), max(until - now, 0.0)) is not None:
        highest += 1
        while self.kv.get(self._ticket_key(highest + 1)) is not None:  # several may have arrived at once
          highest += 1
    return self._close(b, ticket)

  def _await(self, b: int, deadline: float) -> dict:
    """As a member of open batch b: its record, or, if its opener has not closed it in time, our close."""
    del deadline  # the opener's deadline, not ours, governs the close; ours ends the round afterwards
    # With us in it the batch holds two members, so a live opener closes it within window_s; a silent one
    # (stopped) is not waited for past the silence bound.
    grace_s = self.window_s + self.close_grace_s
    why = "in time"  # else: why it was not waited for
    if self._silent is None:
      raw = self.kv.wait(self._batch_key(b), grace_s)
    else:
      end, opener = time.monotonic() + grace_s, None
      while True:
        raw = self.kv.wait(self._batch_key(b), max(min(end - time.monotonic(), self.check_s), 0.0))
        if raw is not None or time.monotonic() >= end:
          break
        if opener is None and (entry := self.kv.get(self._ticket_key(self._last + 1))) is not None:
          opener = int(json.loads(entry)[0])
        if opener is not None and (silent_s := self._silent(opener)) is not None:
          why = f"slot {opener}: its heartbeat has been silent for {silent_s:.3g} s"
          break
    if raw is not None:
      return json.loads(raw)
    self.stats.fallback_closes += 1
    logging.warning("Matchmaking: batch %d was not closed by its opener (%s); slot %d closes it.", b, why, self.slot)
    return self._close(b, self._last + 1)

  def _close(self, b: int, first: int) -> dict:
    last = self.kv.increment(self._ticket, 0)
    entries = []
    for n in range(first, last + 1):
      raw = self.kv.wait(self._ticket_key(n), self.ticket_grace_s)
      if raw is not None:
        slot, inc, progress = json.loads(raw)
        entries.append(Member(int(slot), int(inc), int(progress), n))
    alive = self._live()
    newest: dict[int, Member] = {}
    for m in entries:
      if alive.get(m.slot) == m.incarnation and (m.slot not in newest or m.ticket > newest[m.slot].ticket):
        newest[m.slot] = m
    if self._silent is not None:  # held alive, but silent past the bound (stopped): not grouped with anyone
      newest = {s: m for s, m in newest.items() if s == self.slot or self._silent(s) is None}
    groups, left_out = law.draw_groups(sorted(newest), self.seed, b, odd=self.odd, fragment=self.fragment)
    record = {"b": b, "first": first, "last": last, "closed_by": self.slot, "time": time.time(),
              "members": [[m.ticket, m.slot, m.incarnation, m.progress] for m in newest.values()],
              "excluded": sorted(set(range(first, last + 1)) - {m.ticket for m in newest.values()}),
              "groups": [list(g) for g in groups], "left_out": list(left_out)}
    if self.kv.create(self._batch_key(b), json.dumps(record)):
      self.stats.batches_closed += 1
      self.kv.set(self._latest, f"{b}:{last}")
      self._forget(b - self.keep_batches)
      return record
    return json.loads(self.kv.get(self._batch_key(b)))  # another closer won: its record is the batch

  def _forget(self, b: int) -> None:
    if b < 0:
      return
    raw = self.kv.get(self._batch_key(b))
    if raw is None:
      return
    record = json.loads(raw)
    for n in range(record["first"], record["last"] + 1):
      self.kv.delete(self._ticket_key(n))
    self.kv.delete(self._batch_key(b))


def _group_of(record: dict, ticket: int, slot: int) -> tuple[Member, ...] | None:
  members = {m[1]: Member(m[1], m[2], m[3], m[0]) for m in record["members"]}
  if slot not in members or members[slot].ticket != ticket:
    return None
  for group in record["groups"]:
    if slot in group:
      return tuple(members[s] for s in sorted(group))
  return None
