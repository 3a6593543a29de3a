"""The pairing law (asynchronous/law.py) and its protocol (asynchronous/matchmaking.py), statistically.

Chi-square tests over whole groupings (a batch's grouping is one draw of a multinomial over the
partitions of its members, independent across batches, so the test is exact in its assumptions);
thresholds p > 0.01 (a correct law fails one time in a hundred; every draw is seeded, so a pass is
reproducible). The protocol runs on threads over MemoryKV (the same code as over the service) and,
smaller, on four real processes.
"""

import collections
import itertools
import threading
import time

import numpy as np
import pytest
from scipy import stats

import async_child
from noloco_jax.asynchronous import law, liveness, matchmaking
import memory_kv  # pylint: disable=g-bad-import-order  (tests/memory_kv.py)


def _partitions(members, odd):
  """Every outcome draw_groups can produce for `members`: (groups, left_out) tuples."""
  members = sorted(members)
  out = set()
  for perm in itertools.permutations(members):
    n = len(perm)
    paired = n - 3 if (n % 2 and n >= 3 and odd == "triple") else n - n % 2
    groups = [tuple(sorted(perm[i:i + 2])) for i in range(0, paired, 2)]
    if n % 2 and odd == "triple" and n >= 3:
      groups.append(tuple(sorted(perm[paired:])))
      left = ()
    else:
      left = tuple(perm[paired:])
    out.add((tuple(sorted(groups)), left))
  return sorted(out)


def _canonical(groups, left_out):
  return tuple(sorted(tuple(g) for g in groups)), tuple(left_out)


@pytest.mark.parametrize("num,odd,outcomes", [(4, "triple", 3), (6, "triple", 15), (5, "triple", 10),
                                              (5, "leave_out", 15)])
def test_draw_groups_is_uniform_over_partitions(num, odd, outcomes):
  members = [3 * m + 1 for m in range(num)]  # any slots, not 0 … n−1
  possible = _partitions(members, odd)
  assert len(possible) == outcomes
  draws = 150 * outcomes
  counts = collections.Counter(_canonical(*law.draw_groups(members, seed=5, batch=b, odd=odd)) for b in range(draws))
  assert set(counts) <= set(possible)
  observed = [counts[o] for o in possible]
  assert stats.chisquare(observed).pvalue > 0.01, observed


def test_draw_groups_depends_on_the_member_set_not_the_arrival_order():
  for b in range(50):
    base = law.draw_groups([4, 9, 1, 7, 2, 6], seed=1, batch=b)
    assert law.draw_groups([6, 2, 7, 1, 9, 4], seed=1, batch=b) == base
  assert law.draw_groups([1, 2], seed=1, batch=0) == (((1, 2),), ())
  assert law.draw_groups([5], seed=1, batch=0) == ((), (5,))


def test_draw_groups_rejects_a_slot_twice_and_a_bad_odd_rule():
  with pytest.raises(ValueError, match="appears twice"):
    law.draw_groups([1, 1, 2], seed=0, batch=0)
  with pytest.raises(ValueError, match="odd='pairs'"):
    law.draw_groups([1, 2], seed=0, batch=0, odd="pairs")


@pytest.mark.parametrize("now,count,live,expect", [
    (0.05, 3, 4, False),  # window open, not everyone: wait
    (0.05, 4, 4, True),  # everyone live is here
    (0.11, 2, 4, True),  # window over, a partner here
    (0.11, 1, 4, False),  # window over but alone: keep waiting for a partner
    (2.0, 1, 4, True),  # the opener's budget is spent
])
def test_should_close(now, count, live, expect):
  assert law.should_close(now, 0.0, count, live, window_s=0.1, opener_deadline=2.0) is expect


def test_equal_speeds_reduce_to_the_uniform_random_matching():
  """Six processes at equal speed (round times 1 s ± 1%): every batch holds all six, and the groupings
  over 1500 rounds are uniform over the 15 perfect matchings."""
  rng = np.random.default_rng(0)
  durations = 1.0 + 0.01 * rng.standard_normal((6, 1500))
  sim = law.simulate(durations, window_s=0.1, max_wait_s=2.0, exchange_s=0.02, seed=3)
  assert all(len(b.members) == 6 for b in sim.batches) and len(sim.batches) == 1500
  assert sim.skips.sum() == 0
  counts = collections.Counter(_canonical(b.groups, b.left_out) for b in sim.batches)
  possible = _partitions(range(6), "triple")
  assert stats.chisquare([counts[o] for o in possible]).pvalue > 0.01


def test_a_straggler_meets_every_fast_process_equally_often():
  """One persistent 2× straggler among six: whoever is ready with it is set by arrival order, but among
  the fast processes none is favoured (its partners are uniform over them), and it never waits long."""
  rng = np.random.default_rng(1)
  durations = 1.0 + 0.05 * rng.standard_normal((6, 3000))
  durations[0] *= 2.0
  sim = law.simulate(durations, window_s=0.05, max_wait_s=2.0, exchange_s=0.02, seed=4, until_s=3000)
  partners = collections.Counter()
  for b in sim.batches:
    for g in b.groups:
      if 0 in g:
        partners.update(s for s in g if s != 0)
  observed = [partners[s] for s in range(1, 6)]
  assert sum(observed) > 500
  assert stats.chisquare(observed).pvalue > 0.01, observed
  assert sim.skips[0] == 0 and sim.idle_fraction[0] < 0.1


def test_simulation_bounds_every_wait_by_the_budget():
  rng = np.random.default_rng(2)
  durations = rng.lognormal(0.0, 0.8, size=(5, 400))
  sim = law.simulate(durations, window_s=0.1, max_wait_s=0.5, seed=0)
  per_round = sim.wait_s / sim.rounds
  assert (per_round <= 0.5 + 0.1 + 1e-9).all()
  assert (sim.rounds == 400).all() and (sim.exchanges + sim.skips == sim.rounds).all()


# ---- The protocol on threads over MemoryKV (the same code that runs over the service) ----


def _run_threads(num, rounds, *, window_s=0.05, max_wait_s=5.0, sleep_s=0.005, seed=7, kv=None):
  kv = kv or memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=30.0).start() for s in range(num)]
  makers = [matchmaking.Matchmaker(kv, s, 100 + s, seed=seed, window_s=window_s, max_wait_s=max_wait_s,
                                   live=lives[s].poll) for s in range(num)]
  got = {s: [] for s in range(num)}

  def worker(s):
    rng = np.random.default_rng(s)
    for r in range(rounds):
      time.sleep(sleep_s * rng.random())
      m = makers[s].ready(r)
      got[s].append(None if m is None else (m.batch, tuple(x.slot for x in m.group)))

  threads = [threading.Thread(target=worker, args=(s,)) for s in range(num)]
  [t.start() for t in threads]
  [t.join(timeout=300) for t in threads]
  return got, makers


def test_protocol_agrees_and_is_uniform_at_equal_speed():
  """Four threads, 240 rounds at equal speed: every member of a batch reads the same group, every round
  is matched, and the groupings of the batches that held all four are uniform over the 3 matchings.

  Except at the very end. A thread that misses a batch (the other three close it as a triple when it is
  late by more than the window: under a load average of 27, with a CPU hog per core, once in the whole
  suite) pairs its next round with the others' round after, so it is one round behind from then on, and
  its last round has no partner left: the others have done all theirs. It waits out its budget and skips,
  as the last process of any asynchronous job would. So a thread's final round may go unmatched; no other.
  The budget only has to be far above a wait for a partner who is coming: at most 5 s, seen under a load
  average of 40; 30 s is what the end effect then costs."""
  got, makers = _run_threads(4, 240, max_wait_s=30.0)
  by_batch = collections.defaultdict(set)
  for s, rounds in got.items():
    assert all(r is not None for r in rounds[:-1]), (s, [i for i, r in enumerate(rounds) if r is None])
    for batch, group in filter(None, rounds):
      assert s in group
      by_batch[batch].add(group)
  batches = {}
  for batch, groups in by_batch.items():
    members = set().union(*groups)
    assert sum(len(g) for g in groups) == len(members)  # the groups of a batch are disjoint
    batches[batch] = tuple(sorted(groups))
  full = [g for g in batches.values() if len(set().union(*g)) == 4]
  assert len(full) > 100
  counts = collections.Counter(full)
  assert len(counts) == 3 and stats.chisquare(list(counts.values())).pvalue > 0.01, counts
  assert sum(m.stats.fallback_closes for m in makers) == 0


def test_a_lone_process_skips_after_its_budget():
  kv = memory_kv.MemoryKV()
  live = liveness.Liveness(kv, 0, 1, beat_s=0.05, lease_s=30.0).start()
  maker = matchmaking.Matchmaker(kv, 0, 1, seed=0, window_s=0.01, max_wait_s=0.5, live=live.poll)
  start = time.monotonic()
  assert maker.ready(0) is None
  assert 0.45 < time.monotonic() - start < 10.0
  assert maker.stats.skipped == 1 and maker.stats.tickets == 1  # waited on the store, no ticket churn


def test_fragments_are_matched_apart_and_drawn_independently():
  """Fragment streaming (Matchmaker's `fragment`): a process ready for fragment 0 is never paired with one ready
  for fragment 1 (both skip after their budget); ready for the same fragment, they pair. Each fragment's
  batches are drawn from a stream of their own: over 900 batches of four, the joint grouping of fragments 0
  and 1 at the same batch index is uniform over the 3 × 3 outcomes (independent draws), while fragment=None
  is the unfragmented law's draw."""
  kv = memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=30.0).start() for s in range(2)]
  makers = {(s, f): matchmaking.Matchmaker(kv, s, 100 + s, seed=0, window_s=0.05, max_wait_s=0.5, live=lives[s].poll,
                                           fragment=f) for s in range(2) for f in range(2)}
  out = {}

  def both(fragments):
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, makers[s, fragments[s]].ready(0)))
               for s in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]

  both((0, 1))
  assert out == {0: None, 1: None}
  both((1, 1))
  assert [tuple(m.slot for m in out[s].group) for s in range(2)] == [(0, 1), (0, 1)]
  assert out[0].batch == out[1].batch
  assert kv.get("mm/f1/latest") is not None and kv.get("mm/latest") is None  # keys of its own
  draw = lambda b, f: tuple(sorted(law.draw_groups(range(4), 3, b, fragment=f)[0]))  # the matching
  joint = collections.Counter((draw(b, 0), draw(b, 1)) for b in range(900))
  assert len(joint) == 9 and stats.chisquare(list(joint.values())).pvalue > 0.01, joint
  assert all(law.draw_groups(range(4), 3, b)[0] == law.draw_groups(range(4), 3, b, fragment=None)[0] for b in range(20))


def test_members_close_a_batch_whose_opener_died():
  """A dead opener (it took ticket 1, then vanished: no lease) never closes its batch; the two live
  members close it themselves after window + close_grace_s, without the dead one, and pair."""
  kv = memory_kv.MemoryKV()
  kv.increment(matchmaking.TICKET, 1)
  kv.set("mm/t/1", "[5, 55, 0]")  # slot 5, incarnation 55: holds no lease
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=30.0).start() for s in range(2)]
  makers = [matchmaking.Matchmaker(kv, s, 100 + s, seed=0, window_s=0.05, max_wait_s=10.0, live=lives[s].poll,
                                   close_grace_s=0.5) for s in range(2)]
  out = {}
  threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, makers[s].ready(3))) for s in range(2)]
  start = time.monotonic()
  [t.start() for t in threads]
  [t.join(timeout=60) for t in threads]
  # Bounded by window + close_grace_s (0.55 s), not by the members' budgets (10 s); slack for load.
  assert 0.5 < time.monotonic() - start < 8.0
  assert out[0] is not None and [m.slot for m in out[0].group] == [0, 1]
  assert out[1] is not None and out[1].batch == out[0].batch == 0
  assert sum(m.stats.fallback_closes for m in makers) >= 1
  assert 5 not in {m.slot for m in out[0].group}


def test_leave_out_among_five_pairs_four_and_the_one_left_out_in_the_next_batch():
  """match_odd='leave_out' with more than 3 processes (issue 33's probe; five processes of the trainer through
  the command line trained without a fault): five ready at once form one batch of two pairs and one left
  out (uniformly: law.draw_groups' test), which takes a new ticket at once, opens the next batch and pairs
  there with the next process to be ready, in the same round (its second ticket), not after its budget."""
  kv = memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=30.0).start() for s in range(5)]
  makers = [matchmaking.Matchmaker(kv, s, 100 + s, seed=3, window_s=2.0, max_wait_s=30.0, live=lives[s].poll,
                                   odd="leave_out") for s in range(5)]
  out = {}
  threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, makers[s].ready(6))) for s in range(5)]
  try:
    [t.start() for t in threads]
    end = time.monotonic() + 60
    while len(out) < 4 and time.monotonic() < end:  # the two pairs; the one left out waits in batch 1
      time.sleep(0.02)
    assert len(out) == 4, out
    [left] = set(range(5)) - set(out)
    assert all(m.batch == 0 and len(m.group) == 2 and m.tickets == 1 for m in out.values()), out
    groups = {tuple(x.slot for x in m.group) for m in out.values()}  # each pair as both its members read it
    assert len(groups) == 2 and sorted(sum(groups, ())) == sorted(set(range(5)) - {left}), groups
    next_one = min(out)
    start = time.monotonic()
    again = makers[next_one].ready(9)
    [t.join(timeout=60) for t in threads]
    assert time.monotonic() - start < 10.0  # paired at once (window 2 s), not after the 30 s budget
    assert again is not None and again.batch == out[left].batch == 1, (again, out.get(left))
    assert [m.slot for m in again.group] == sorted([left, next_one]) and out[left].tickets == 2
    assert {m.slot: m.progress for m in again.group} == {left: 6, next_one: 9}
  finally:
    for live in lives:
      live.leave()


def test_a_process_held_lost_returns_and_is_grouped_again():
  """Issue 33 item 7: a process whose heartbeat stops for longer than a lease (SIGSTOP, a swapped-out host)
  is held lost; when its heartbeat moves again, same incarnation, it has *returned*: alive again, and the
  next batch groups it with its peer (docs/async.md §2, §5). Its peer's events say lost, then returned."""
  kv = memory_kv.MemoryKV()
  lives = [liveness.Liveness(kv, s, 100 + s, beat_s=0.05, lease_s=0.5).start() for s in range(2)]
  makers = [matchmaking.Matchmaker(kv, s, 100 + s, seed=0, window_s=0.05, max_wait_s=20.0, live=lives[s].poll)
            for s in range(2)]

  def wait_for(event):
    end = time.monotonic() + 60
    while time.monotonic() < end:
      lives[0].poll()
      if any(e["slot"] == 1 and e["event"] == event for e in lives[0].events):
        return
      time.sleep(0.02)
    raise AssertionError(f"slot 0 never saw slot 1 {event}: {lives[0].events}")

  try:
    stalled = lives[1]
    stalled._stop.set()  # pylint: disable=protected-access  (stopped: no beat, no goodbye)
    stalled._thread.join(timeout=5)  # pylint: disable=protected-access
    wait_for("lost")
    assert 1 not in lives[0].poll()
    stalled._stop.clear()  # pylint: disable=protected-access  (resumed: the same incarnation beats again)
    stalled.start()
    wait_for("returned")
    assert lives[0].poll() == {0: 100, 1: 101}
    assert [e["event"] for e in lives[0].events if e["slot"] == 1] == ["joined", "lost", "returned"]
    out = {}
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, makers[s].ready(4))) for s in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert out[0] is not None and out[1] is not None, out
    assert [m.slot for m in out[0].group] == [m.slot for m in out[1].group] == [0, 1]
  finally:
    for live in lives:
      live.leave()


def test_bad_matchmaker_settings_name_the_value():
  kv = memory_kv.MemoryKV()
  with pytest.raises(ValueError, match="max_wait_s=0"):
    matchmaking.Matchmaker(kv, 0, 1, seed=0, window_s=0.1, max_wait_s=0, live=dict)
  with pytest.raises(ValueError, match="window_s=-1"):
    matchmaking.Matchmaker(kv, 0, 1, seed=0, window_s=-1, max_wait_s=1, live=dict)


# ---- Four real processes on JAX's coordination service ----


def test_four_processes_agree_on_every_batch(tmp_path):
  """40 rounds at equal speed: every round matched, every member of a batch reports the same groups,
  and no matching of four is missing (a loose check of uniformity on few rounds: p > 0.001)."""
  codes, results = async_child.launch("match", 4, tmp_path, 40, 0.3, 5, timeout_s=300)
  assert codes == [0, 0, 0, 0], async_child.logs(tmp_path, "match")
  by_batch = collections.defaultdict(set)
  for s, r in results.items():
    assert all(g is not None for g in r["groups"]), (s, r["stats"])
    for batch, group in r["groups"]:
      by_batch[batch].add(tuple(group))
  for batch, groups in by_batch.items():
    slots = [s for g in groups for s in g]
    assert len(slots) == len(set(slots)), (batch, groups)  # members agree: disjoint groups, each once
  full = collections.Counter(tuple(sorted(g)) for g in by_batch.values() if sum(map(len, g)) == 4)
  assert len(full) == 3 and stats.chisquare(list(full.values())).pvalue > 0.001, full
