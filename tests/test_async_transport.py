"""The exchange over jax.experimental.transfer (asynchronous/transport.py): values, bounded waits, dead partners.

Two transfer servers in one process (MemoryKV for the store) test the protocol and its watchdog in
seconds; three real processes test it over the coordination service, with a partner that stays away
and one that is killed while its message is being pulled.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import async_child
from noloco_jax.asynchronous import matchmaking, transport
import memory_kv  # pylint: disable=g-bad-import-order  (tests/memory_kv.py)


def _pair():
  kv = memory_kv.MemoryKV()
  return kv, transport.Transport(kv, 0, 10), transport.Transport(kv, 1, 11)


def _member(slot, incarnation):
  return matchmaking.Member(slot, incarnation, 0, 0)


def test_two_servers_exchange_pytrees():
  kv, a, b = _pair()
  msg_a = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(5, jnp.bfloat16)}
  msg_b = jax.tree.map(lambda x: -x, msg_a)
  out = {}
  t = threading.Thread(target=lambda: out.__setitem__("b", b.exchange(msg_b, [_member(0, 10)], 7, timeout_s=60)))
  t.start()
  got_a = a.exchange(msg_a, [_member(1, 11)], 7, timeout_s=60)
  t.join(timeout=60)
  for k in msg_a:
    np.testing.assert_array_equal(np.asarray(got_a[0][k]), np.asarray(msg_b[k]))
    np.testing.assert_array_equal(np.asarray(out["b"][0][k]), np.asarray(msg_a[k]))
    assert got_a[0][k].dtype == msg_a[k].dtype
  assert a.stats.exchanges == 1 and a.stats.bytes_received == sum(x.nbytes for x in jax.tree.leaves(msg_b))


def test_a_message_sharded_over_local_devices_arrives_in_the_same_sharding():
  """A process holding several replicas sends them as one [k, ...] array over its devices."""
  kv, a, b = _pair()
  mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("replica",))
  sharding = jax.NamedSharding(mesh, jax.P("replica"))
  x_a = jax.device_put(jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6), sharding)
  x_b = jax.device_put(-jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6), sharding)
  out = {}
  t = threading.Thread(target=lambda: out.__setitem__("b", b.exchange({"x": x_b}, [_member(0, 10)], 9, 60)))
  t.start()
  got = a.exchange({"x": x_a}, [_member(1, 11)], 9, timeout_s=60)[0]["x"]
  t.join(timeout=60)
  assert got.sharding == sharding
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x_b))
  np.testing.assert_array_equal(np.asarray(out["b"][0]["x"]), np.asarray(x_a))


def test_jax_pull_timeout_does_not_end_a_pull_of_nothing():
  """The JAX limit transport.py works around (docs/async.md §8): a pull of an id never offered ignores
  its own 1 s deadline; only the poisoned connection ends it, 4 s later. If a JAX upgrade makes the
  deadline work, this fails and the watchdog can go."""
  import datetime  # pylint: disable=g-import-not-at-top
  _, a, b = _pair()
  conn = a.server.connect(b.server.address())
  spec = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  threading.Timer(4.0, conn._poison_connection).start()  # pylint: disable=protected-access
  start = time.monotonic()
  with pytest.raises(Exception, match="InjectFailure|Connection closed"):  # ended by the poisoning, not by 1 s
    got = conn.pull(transport.uuid(1, 1, 0), [spec], timeout=datetime.datetime.now() + datetime.timedelta(seconds=1))
    jax.block_until_ready(got)  # pull returns at once; its arrays are ready when the data came
  assert time.monotonic() - start > 3.5


def test_a_partner_that_never_offers_fails_the_exchange_at_its_timeout():
  kv, a, _ = _pair()
  start = time.monotonic()
  with pytest.raises(transport.ExchangeFailed, match="slot 1 failed: it did not offer"):
    a.exchange({"x": jnp.ones(4)}, [_member(1, 11)], 3, timeout_s=1.0)
  assert 0.9 < time.monotonic() - start < 20.0
  assert a.stats.failures == 1


def test_the_watchdog_ends_a_pull_of_a_message_that_never_comes():
  """The partner announces an offer it never makes: the pull itself would wait forever (its own timeout
  is not applied when nothing was offered); the watchdog ends it at the deadline and the connection
  is replaced by a new one for the next exchange."""
  kv, a, b = _pair()
  x = {"x": jnp.ones(4)}
  kv.set("x/5/1", transport.signature(jax.tree.leaves(x)))  # "offered", but nothing is
  start = time.monotonic()
  with pytest.raises(transport.ExchangeFailed, match="no message by the deadline"):
    a.exchange(x, [_member(1, 11)], 5, timeout_s=1.5)
  assert 1.4 < time.monotonic() - start < 20.0
  # The next exchange with the same partner works (on a fresh connection).
  out = {}
  t = threading.Thread(target=lambda: out.__setitem__("b", b.exchange({"x": 2 * jnp.ones(4)}, [_member(0, 10)], 6, 60)))
  t.start()
  got = a.exchange(x, [_member(1, 11)], 6, timeout_s=60)
  t.join(timeout=60)
  np.testing.assert_array_equal(np.asarray(got[0]["x"]), 2 * np.ones(4))


def test_a_restarted_partner_is_not_mistaken_for_the_old_one():
  kv, a, _ = _pair()
  with pytest.raises(transport.ExchangeFailed, match="incarnation 11, not 99"):
    kv.set("x/4/1", transport.signature([jnp.ones(4)]))
    a.exchange({"x": jnp.ones(4)}, [_member(1, 99)], 4, timeout_s=5.0)


def test_different_message_structures_are_a_config_error():
  kv, a, _ = _pair()
  kv.set("x/8/1", transport.signature([jnp.ones(3)]))
  with pytest.raises(ValueError, match="same structure"):
    a.exchange({"x": jnp.ones(4)}, [_member(1, 11)], 8, timeout_s=5.0)


def test_ids_are_unique_and_bounded():
  ids = {transport.uuid(t, o, p) for t in (0, 1, 2**39) for o in range(4) for p in range(4)}
  assert len(ids) == 3 * 16 and max(ids) < 2**64
  with pytest.raises(ValueError, match="slots must be"):
    transport.uuid(0, 1 << 12, 0)


def test_three_processes_exchange_then_survive_an_absent_and_a_killed_partner(tmp_path):
  """Four rounds of 4 MB messages in the groups the matchmaker forms (pairs or a triple): every message
  received is the one its sender sent in the round it reported. Then slot 1 stays away from an
  exchange (slot 0 fails it at its 3 s timeout) and is killed while slot 0 pulls a 64 MB message from
  it (slot 0 fails at once: the connection closes; bounded by the 60 s timeout in any case)."""
  codes, results = async_child.launch("exchange", 3, tmp_path, timeout_s=300)
  assert codes == [0, -9, 0], async_child.logs(tmp_path, "exchange")
  exchanged = 0
  for slot in (0, 2):
    for r in results[slot]["rounds"]:
      if r is None:
        continue
      exchanged += 1
      for sender, (round_, first, last, size) in r["received"].items():
        assert first == last == 100 * int(sender) + round_ and size == 2**20, (slot, r)
  assert exchanged >= 4
  r = results[0]
  assert "did not offer" in r["absent"] and 2.9 < r["absent_s"] < 20.0, r
  assert "pull failed" in r["killed"] or r["killed"] == "no error", r
  assert r["killed_s"] < 60.0 and r["failed_at"] - r["killed_at"] < 30.0, r
