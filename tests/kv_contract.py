"""The contract of the control plane's store (asynchronous/control.KV), checked on every implementation.

    check(make_kv)      make_kv() → a fresh KV handle on one shared store (several handles race in threads)

Used by tests/test_async_control.py (MemoryKV; JaxKV over an in-process coordination service) and
tests/test_async_etcd.py (EtcdKV over a real etcd cluster). Every wait is bounded.
"""

import threading
import time


def check(make_kv, *, wait_slack_s: float = 5.0) -> None:
  kv = make_kv()
  others = [make_kv() for _ in range(3)]
  _get_set_delete(kv, others[0])
  _create_has_one_winner(kv, others)
  _increment_is_atomic(kv, others)
  _wait_times_out_and_wakes(kv, others[0], wait_slack_s)
  _dir_is_a_prefix(kv, others[0])


def _get_set_delete(kv, other):
  assert kv.get("c/absent") is None
  kv.set("c/k", "1")
  assert other.get("c/k") == "1"
  other.set("c/k", "2")  # set overwrites
  assert kv.get("c/k") == "2"
  kv.delete("c/k")
  assert other.get("c/k") is None
  kv.delete("c/never-written")  # deleting an absent key is no error


def _create_has_one_winner(kv, others):
  assert kv.create("c/once", "a") and not others[0].create("c/once", "b") and others[0].get("c/once") == "a"
  handles = [kv, *others]
  wins = [None] * 8
  def race(i):
    wins[i] = handles[i % len(handles)].create("c/race", str(i))
  threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
  [t.start() for t in threads]
  [t.join(timeout=60) for t in threads]
  assert sum(bool(w) for w in wins) == 1, wins
  winner = next(i for i, w in enumerate(wins) if w)
  assert kv.get("c/race") == str(winner)


def _increment_is_atomic(kv, others):
  assert kv.increment("c/n", 1) == 1 and kv.increment("c/n", 0) == 1 and others[0].increment("c/n", 5) == 6
  handles = [kv, *others]
  def count(h):
    for _ in range(10):
      h.increment("c/m", 1)
  threads = [threading.Thread(target=count, args=(h,)) for h in handles]
  [t.start() for t in threads]
  [t.join(timeout=120) for t in threads]
  assert kv.increment("c/m", 0) == 10 * len(handles)


def _wait_times_out_and_wakes(kv, other, slack_s):
  start = time.monotonic()
  assert kv.wait("c/never", 1.0) is None
  assert 0.9 < time.monotonic() - start < 1.0 + slack_s
  kv.set("c/there", "x")
  start = time.monotonic()
  assert kv.wait("c/there", 30.0) == "x" and time.monotonic() - start < slack_s  # present: at once
  threading.Timer(0.3, lambda: other.set("c/late", "v")).start()
  start = time.monotonic()
  assert kv.wait("c/late", 30.0) == "v"
  woke = time.monotonic() - start
  assert 0.25 < woke < 0.3 + slack_s, woke


def _dir_is_a_prefix(kv, other):
  kv.set("d/a", "1")
  other.set("d/b", "2")
  kv.set("dd/c", "3")
  assert kv.dir("d/") == {"d/a": "1", "d/b": "2"}
