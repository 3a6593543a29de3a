"""The control plane's store (asynchronous/control.py) and liveness leases (asynchronous/liveness.py).

Unit tests run the in-process MemoryKV (tests/memory_kv.py) and the lease table on a fake clock; the multi-process tests run
three processes over loopback on JAX's coordination service (each launch takes 10–40 s on a loaded
2-core machine, most of it starting JAX; the timeouts allow several times that).
"""

import threading
import time

import pytest

import async_child
import kv_contract
from noloco_jax.asynchronous import control, liveness, session
import memory_kv  # pylint: disable=g-bad-import-order  (tests/memory_kv.py)


# ---- MemoryKV: the same semantics as the service, in one process ----


def test_memory_kv_create_is_won_once_among_racing_threads():
  kv = memory_kv.MemoryKV()
  wins = []
  threads = [threading.Thread(target=lambda i=i: wins.append(kv.create("k", str(i)))) for i in range(16)]
  [t.start() for t in threads]
  [t.join() for t in threads]
  assert sum(wins) == 1 and kv.get("k") is not None


def test_memory_kv_increment_wait_dir_delete():
  kv = memory_kv.MemoryKV()
  assert kv.increment("n", 1) == 1 and kv.increment("n", 0) == 1 and kv.increment("n", 5) == 6
  start = time.monotonic()
  assert kv.wait("missing", 0.2) is None
  assert 0.15 < time.monotonic() - start < 5.0
  threading.Timer(0.1, lambda: kv.set("late", "v")).start()
  assert kv.wait("late", 10.0) == "v"
  kv.set("d/a", "1")
  kv.set("d/b", "2")
  assert kv.dir("d/") == {"d/a": "1", "d/b": "2"}
  kv.delete("d/a")
  assert kv.get("d/a") is None


def test_memory_kv_keeps_the_kv_contract():
  kv = memory_kv.MemoryKV()
  kv_contract.check(lambda: kv)


def test_jax_kv_keeps_the_kv_contract():
  """JaxKV over a coordination service and a client in this process (tests/test_async_etcd.py: the same on etcd)."""
  connection = control.connect(f"127.0.0.1:{control._spare_port('127.0.0.1')}", 1, 0,  # pylint: disable=protected-access
                               heartbeat_timeout_s=10, initialization_timeout_s=60)
  try:
    kv_contract.check(lambda: connection.kv)
  finally:
    connection.client.shutdown()  # the client says goodbye before its service goes (else it aborts the process)
    connection.service.shutdown()


# ---- The lease table on a fake clock ----


def test_lease_table_joins_loses_leaves_and_returns():
  table = liveness.LeaseTable(me=0, lease_s=10.0)
  assert [e["event"] for e in table.observe({0: "7:1", 1: "8:1", 2: "9:1"}, now=0.0)] == ["joined"] * 3
  assert table.observe({0: "7:5", 1: "8:4", 2: "9:1"}, now=9.9) == []  # slot 2 silent for 9.9 s < lease
  lost = table.observe({0: "7:6", 1: "8:5", 2: "9:1"}, now=10.1)
  assert [(e["slot"], e["event"]) for e in lost] == [(2, "lost")]
  assert sorted(table.alive()) == [0, 1]
  assert [(e["slot"], e["event"]) for e in table.observe({0: "7:7", 1: "8:left", 2: "9:2"}, now=11.0)] == [
      (1, "left"), (2, "returned")]
  assert sorted(table.alive()) == [0, 2]
  # A restart: the same slot with a new incarnation is a new member.
  events = table.observe({0: "7:8", 1: "12:1", 2: "9:3"}, now=12.0)
  assert [(e["slot"], e["incarnation"], e["event"]) for e in events] == [(1, 12, "joined")]
  assert table.alive() == {0: 7, 1: 12, 2: 9}
  # Restarted before its old lease ran out: the old incarnation is lost, the new one joins.
  events = table.observe({0: "7:9", 1: "12:2", 2: "13:1"}, now=13.0)
  assert [(e["slot"], e["incarnation"], e["event"]) for e in events] == [(2, 9, "lost"), (2, 13, "joined")]


def test_this_process_is_never_lost_to_itself():
  table = liveness.LeaseTable(me=3, lease_s=1.0)
  table.observe({3: "1:1"}, now=0.0)
  assert table.observe({3: "1:1"}, now=100.0) == [] and 3 in table.alive()


def test_silence_is_counted_from_the_last_change_seen_and_a_stopped_observer_sees_beats_it_missed():
  """liveness.Liveness.silent_past (the bound of issue 33 item 7) on a fake clock: a peer whose value stops
  moving is silent from the last read that saw it move; an observer that was itself stopped for long (its
  clock jumps 50 s) does not take a peer that beat meanwhile for silent: it reads the leases first."""
  now = [0.0]
  kv = memory_kv.MemoryKV()
  me = liveness.Liveness(kv, 0, 1, beat_s=0.5, lease_s=100.0, clock=lambda: now[0])
  peer = liveness.Liveness(kv, 1, 2, beat_s=0.5, lease_s=100.0, clock=lambda: now[0])
  me.beat(), peer.beat()
  assert me.silent_past(1, 2.0) is None and me.silent_past(0, 0.0) is None  # never silent to itself
  now[0] = 1.0
  peer.beat()
  assert me.silent_past(1, 2.0) is None
  now[0] = 3.5  # no beat since 1.0: 2.5 s
  assert me.silent_past(1, 2.0) == pytest.approx(2.5) and me.silent_past(1, 3.0) is None
  now[0] = 60.0  # this observer was stopped meanwhile; the peer beat
  peer.beat()
  assert me.silent_past(1, 2.0) is None
  now[0] = 63.0
  assert me.silent_past(1, 2.0) == pytest.approx(3.0)


def test_liveness_over_memory_kv_sees_a_silent_thread_lost():
  kv = memory_kv.MemoryKV()
  a = liveness.Liveness(kv, 0, 1, beat_s=0.02, lease_s=0.3).start()
  b = liveness.Liveness(kv, 1, 2, beat_s=0.02, lease_s=0.3).start()
  assert sorted(a.poll()) == [0, 1]
  b._stop.set()  # pylint: disable=protected-access  (stops beating without saying goodbye: a crash)
  end = time.monotonic() + 30
  while 1 in a.poll() and time.monotonic() < end:
    time.sleep(0.02)
  assert 1 not in a.poll() and a.events[-1]["event"] == "lost"
  a.leave()


def test_a_newcomer_tells_a_beating_peer_from_a_dead_one():
  """A just-started observer holds every lease it sees alive until a lease passes; `beating` does not
  wait that long: it keeps only the slots whose heartbeat moves (what a joiner picks donors from)."""
  kv = memory_kv.MemoryKV()
  alive = liveness.Liveness(kv, 0, 1, beat_s=0.02, lease_s=30.0).start()
  kv.set("live/1", "2:57")  # the last beat of a process that has died
  newcomer = liveness.Liveness(kv, 2, 3, beat_s=0.02, lease_s=30.0).start()
  assert sorted(newcomer.poll()) == [0, 1, 2]
  assert newcomer.beating() == {0: 1}
  alive.leave()
  newcomer.leave()


def test_an_observing_newcomer_tells_them_apart_from_what_it_has_read_since_start_up(monkeypatch):
  """Observing from start-up (what a trainer's process does: job.py), `beating` waits only what is left of
  its 3 beats since the first read, on a fake clock: a peer whose value moved within them beats; a lease
  never seen to move (a dead process's last), one that moved and then stopped longer ago, one that left and a
  restarted peer not yet seen to move since its restart do not."""
  now, slept = [0.0], []
  monkeypatch.setattr(liveness.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
  kv = memory_kv.MemoryKV()
  me = liveness.Liveness(kv, 0, 1, beat_s=0.5, lease_s=30.0, clock=lambda: now[0], observe=True)
  kv.set("live/1", "2:1"), kv.set("live/2", "3:9"), kv.set("live/3", "4:1"), kv.set("live/4", "5:1")
  kv.set("live/5", "6:1")
  me.poll()  # its first read: t = 0
  now[0] = 0.4
  kv.set("live/1", "2:2"), kv.set("live/3", "4:2"), kv.set("live/5", "6:left")
  me.poll()
  now[0] = 1.0
  assert me.beating() == {1: 2, 3: 4} and slept == [pytest.approx(0.5)]  # 1.5 s of reads: 0.5 s left to wait
  kv.set("live/1", "2:3"), kv.set("live/4", "7:1")  # slot 4 restarted: a new incarnation, seen once
  now[0] = 2.5  # slot 3 last moved at 0.4, 2.1 s ago: stopped since
  assert me.beating() == {1: 2} and slept[-1] == 0.0
  kv.set("live/1", "2:4"), kv.set("live/4", "7:2")
  now[0] = 2.6
  assert me.beating() == {1: 2, 4: 7}


@pytest.mark.parametrize("kwargs,field", [(dict(beat_s=2.0, lease_s=1.0), "beat_s=2.0"),
                                          (dict(beat_s=0.1, lease_s=-1.0), "beat_s=0.1")])
def test_bad_lease_settings_name_the_value(kwargs, field):
  with pytest.raises(ValueError, match=field):
    liveness.Liveness(memory_kv.MemoryKV(), 0, 1, **kwargs)


@pytest.mark.parametrize("field,value,named", [
    ("max_wait_s", 0.0, "outer.asynchronous.max_wait_s=0.0 is not valid"), ("window_s", -1.0, "outer.asynchronous.match_window_s=-1.0"),
    ("exchange_timeout_s", 0.0, "outer.asynchronous.exchange_timeout_s=0.0"), ("odd", "pairs", "outer.asynchronous.match_odd='pairs'"),
    ("lease_s", 0.1, "outer.asynchronous.lease_s=0.1"),
    ("partner_silence_s", 0.4, "outer.asynchronous.partner_silence_s=0.4 is not valid with a heartbeat every 0.5 s")])
def test_bad_session_options_are_one_line_naming_the_field(field, value, named):
  with pytest.raises(ValueError, match=named.replace("(", r"\(")) as e:
    session.Options(**{field: value}).check()
  assert "\n" not in str(e.value)


# ---- Over JAX's coordination service, three processes ----


def test_service_store_operations_from_three_processes(tmp_path):
  codes, results = async_child.launch("kv", 3, tmp_path, timeout_s=240)
  assert codes == [0, 0, 0], async_child.logs(tmp_path, "kv")
  assert sum(r["won"] for r in results.values()) == 1  # insert-if-absent: exactly one winner
  winner = next(str(s) for s, r in results.items() if r["won"])
  assert all(r["winner"] == winner for r in results.values())
  assert all(r["counter"] == 30 for r in results.values())  # 3 processes × 10 atomic increments
  assert all(r["missing"] is None and r["absent_get"] is None for r in results.values())
  # A wait on a key nobody writes returns None after its timeout (1 s), not before, and not much after.
  assert all(0.9 < r["wait_s"] < 15.0 for r in results.values())


def test_a_killed_process_is_seen_lost_and_a_leaving_one_left(tmp_path):
  """Slot 2 is SIGKILLed, slot 1 leaves normally; slot 0 sees slot 2 lost a lease after its last beat
  (lease 3 s, beats every 0.3 s: between 2.7 s and 3 s + polling after the kill; 15 s of slack for load)
  and slot 1 left at its next poll."""
  lease_s = 3.0
  codes, results = async_child.launch("lease", 3, tmp_path, lease_s, timeout_s=240)
  assert codes[:2] == [0, 0] and codes[2] == -9, async_child.logs(tmp_path, "lease")
  r = results[0]
  events = {(e["slot"], e["event"]): e["time"] for e in r["events"]}
  assert (2, "lost") in events and (1, "left") in events, r["events"]
  lost_after = events[(2, "lost")] - r["killed_at"]
  assert lease_s - 0.5 < lost_after < lease_s + 15.0, lost_after
  assert events[(1, "left")] - r["left_at"] < 10.0
  assert r["alive"] == [0]
