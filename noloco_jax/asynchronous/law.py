"""The pairing law of the asynchronous schedule, as pure functions (the matchmaker's protocol runs them).

Processes become *ready* (their replicas finished H inner steps) at times of their own. The law:

1. Ready processes are put in order by an atomic ticket counter and cut into *batches*: a batch opens
   at its first ticket and takes every later ticket until it closes.
2. A batch closes at the first moment when (a) it holds at least two processes and either it holds
   every live process or `window_s` has passed since it opened, or (b) its opener's wait budget
   (`max_wait_s` from the moment it became ready) has run out (`should_close`).
3. A closed batch's members are split into groups by a uniformly random partition drawn from
   (seed, batch index), over the members sorted by slot (`draw_groups`): pairs, and with an odd
   count either one triple (`odd="triple"`, the default: NoLoCo's group mean over three, so that no
   ready process is turned away) or one member left out (`odd="leave_out"`), uniformly chosen.
4. A left-out process whose budget has not run out takes a new ticket (it usually opens the next
   batch); one whose budget has run out skips the exchange of this round (counted).

What it guarantees. Arrival order decides only *which batch* a process lands in; within a batch, the
grouping does not depend on the order of the tickets, only on the set of members, and every
partition of that set (into pairs, plus one triple or one left out) is equally likely. So no pair is
favoured beyond what arrival order forces: two processes meet only if one becomes ready while the
other's batch is open. With equal speeds every live process lands in one batch (their arrivals
spread over less than `window_s`) and, with an even count, the law *is* the uniformly random perfect
matching of the synchronous schedule (tests/test_async_matchmaking.py checks both with chi-square
tests). A process waits at most `max_wait_s` for a partner, plus the time to close its batch; it
never waits for anyone but the members of its batch.

`simulate` runs the law on given round durations with no store and no network (idealised: closing
and messaging take no time, an exchange takes `exchange_s`): the deterministic simulation behind the
statistical tests, and the model of the schedule's idle time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from noloco_jax.parallel import permutations

ODD_RULES = ("triple", "leave_out")


def draw_groups(members: Sequence[int], seed: int, batch: int, *, odd: str = "triple", fragment: int | None = None
                ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
  """(groups, left_out) of one batch: a uniformly random partition of `members` (slots) into pairs.

  With an odd count of at least three, `odd` = "triple" makes the last three of the draw one group
  (a uniformly random partition into pairs and one triple), "leave_out" leaves the last one out.
  Depends on the *set* of members only (they are sorted first), the seed and the batch index; every
  process that reads the batch's members draws the same groups. Groups are sorted tuples of slots.
  `fragment`: fragment streaming's fragment f (each fragment's batches are its own, a draw of their own).
  """
  if odd not in ODD_RULES:
    raise ValueError(f"odd={odd!r} is not valid; choose one of {ODD_RULES}.")
  slots = sorted(int(m) for m in members)
  if len(set(slots)) != len(slots):
    raise ValueError(f"members={list(members)} is not valid: a slot appears twice in one batch.")
  counters = (batch,) if fragment is None else (batch, fragment)
  order = [slots[i] for i in permutations.generator(permutations.STREAM_ASYNC_MATCH, seed, *counters).permutation(len(slots))]
  n = len(order)
  paired = n - (n % 2)
  if n % 2 and n >= 3 and odd == "triple":
    paired = n - 3
  groups = [tuple(sorted(order[i:i + 2])) for i in range(0, paired, 2)]
  if paired == n - 3:
    groups.append(tuple(sorted(order[paired:])))
    return tuple(groups), ()
  return tuple(groups), tuple(order[paired:])


def should_close(now: float, opened_at: float, count: int, live_count: int, window_s: float,
                 opener_deadline: float) -> bool:
  """Whether an open batch of `count` members closes at time `now` (rule 2 of the module docstring)."""
  if now >= opener_deadline:
    return True
  return count >= 2 and (count >= live_count or now - opened_at >= window_s)


@dataclasses.dataclass(frozen=True)
class Batch:
  index: int
  opened_at: float
  closed_at: float
  members: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  left_out: tuple[int, ...]


@dataclasses.dataclass
class Simulation:
  batches: list[Batch]
  rounds: np.ndarray  # [P] rounds finished (an exchange or a skip each)
  exchanges: np.ndarray  # [P] rounds that ended in an exchange
  skips: np.ndarray  # [P] rounds whose budget ran out with no partner
  wait_s: np.ndarray  # [P] total seconds spent ready but not yet paired (or skipped)
  busy_s: np.ndarray  # [P] total seconds of inner steps
  end_s: np.ndarray  # [P] when each process finished its last round

  @property
  def idle_fraction(self) -> np.ndarray:
    """[P] share of each process's time spent waiting for a partner (exchange time excluded)."""
    return self.wait_s / np.maximum(self.end_s, 1e-12)


def simulate(durations: np.ndarray, *, window_s: float, max_wait_s: float,
             exchange_s: float | Callable[[tuple[int, ...]], float] = 0.0, seed: int = 0,
             live: Sequence[int] | None = None, until_s: float | None = None, odd: str = "triple",
             overlap: float = 0.0) -> Simulation:
  """The law on a job whose process p spends durations[p, r] seconds on the inner steps of its round r.

  Every process runs durations.shape[1] rounds, or, with `until_s`, starts no round after that time
  (so that processes of different speeds are compared over the same wall time). `live`: the slots
  taking part (default all). `exchange_s`: seconds of every exchange, or a function of its group (slots,
  sorted): links of their own per process. `overlap` ω in [0, 1): the round runs beside the first ω of the
  next round's inner steps (outer.overlap_steps τ = ω·H), and the process waits only for what is left of
  it after them: it becomes ready next at ready + d + max(0, done − (ready + ω·d)).
  """
  if not 0.0 <= overlap < 1.0:
    raise ValueError(f"overlap={overlap} is not valid: a fraction of a round in [0, 1).")
  durations = np.asarray(durations, np.float64)
  num, rounds = durations.shape
  slots = list(range(num)) if live is None else sorted(live)
  live_count = len(slots)
  done = np.zeros(num, np.int64)
  exchanges, skips = np.zeros(num, np.int64), np.zeros(num, np.int64)
  wait_s, busy_s, end_s = np.zeros(num), np.zeros(num), np.zeros(num)
  ready_at = {p: durations[p, 0] for p in slots}  # next time each process becomes (or re-enters as) ready
  deadline = {p: durations[p, 0] + max_wait_s for p in slots}
  waiting_since = {p: durations[p, 0] for p in slots}
  for p in slots:
    busy_s[p] += durations[p, 0]
  batches: list[Batch] = []
  open_members: list[int] = []
  opened_at = 0.0

  def finish_round(p: int, t: float, group: tuple[int, ...] | None) -> None:
    wait_s[p] += t - waiting_since[p]
    done[p] += 1
    (exchanges if group else skips)[p] += 1
    cost = (exchange_s(group) if callable(exchange_s) else exchange_s) if group else 0.0
    end = t + cost
    end_s[p] = end
    if done[p] < rounds and (until_s is None or end < until_s):
      d = durations[p, done[p]]
      busy_s[p] += d
      if overlap:  # the next round's first ω·d ran meanwhile
        start = waiting_since[p]
        ready_at[p] = waiting_since[p] = start + d + max(0.0, end - (start + overlap * d))
      else:
        ready_at[p] = waiting_since[p] = end + d
      deadline[p] = ready_at[p] + max_wait_s
    else:
      del ready_at[p]

  while ready_at or open_members:
    pending = {p: t for p, t in ready_at.items() if p not in open_members}
    next_arrival = min(pending.values()) if pending else np.inf
    if open_members:
      opener_deadline = deadline[open_members[0]]
      close_at = opener_deadline if len(open_members) < 2 else min(opened_at + window_s, opener_deadline)
    else:
      close_at = np.inf
    if next_arrival < close_at:  # (a batch holding every live process was closed at its last arrival)
      p = min(pending, key=lambda q: (pending[q], q))
      if not open_members:
        opened_at = next_arrival
      open_members.append(p)
      if should_close(next_arrival, opened_at, len(open_members), live_count, window_s, deadline[open_members[0]]):
        _close(batches, open_members, opened_at, next_arrival, seed, odd, deadline, finish_round, ready_at)
        open_members = []
      continue
    t = max(close_at, opened_at)
    _close(batches, open_members, opened_at, t, seed, odd, deadline, finish_round, ready_at)
    open_members = []
  return Simulation(batches, done, exchanges, skips, wait_s, busy_s, end_s)


def _close(batches, members, opened_at, t, seed, odd, deadline, finish_round, ready_at) -> None:
  index = len(batches)
  groups, left_out = draw_groups(members, seed, index, odd=odd)
  batches.append(Batch(index, opened_at, t, tuple(members), groups, left_out))
  for group in groups:
    for p in group:
      finish_round(p, t, group)
  for p in left_out:
    if t < deadline[p]:
      ready_at[p] = t  # takes a new ticket at once
    else:
      finish_round(p, t, None)
