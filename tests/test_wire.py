"""outer/wire.py: bytes on the wire per replica, pinned to a NumPy run of each algorithm and to the
collectives XLA compiles for each method (tools/hlo.py: wire_bytes)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from noloco_jax.config.outer import OuterConfig, RuleConfig
from noloco_jax.outer import epidemic, pairing, wire
from noloco_jax.tools import dryrun
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.training.loop_state import LoopState

# ---- NumPy runs of the algorithms: move real data, count the bytes each worker sends ----


def _ring_allreduce(x: np.ndarray):
  """x [N, E]: a ring reduce-scatter then all-gather over N workers. Returns (result, sent, received,
  steps) with sent/received the bytes (float32) each worker moved."""
  n, e = x.shape
  chunks = np.array_split(np.arange(e), n)
  buf = x.astype(np.float64).copy()
  sent, received = np.zeros(n), np.zeros(n)
  steps = 0
  for phase in ("reduce", "gather"):
    for step in range(n - 1):
      steps += 1
      # Worker i sends chunk (i − step) (reduce) or (i + 1 − step) (gather) to worker i + 1, all at once.
      moves = [(i, (i - step) % n if phase == "reduce" else (i + 1 - step) % n) for i in range(n)]
      payload = [buf[i, chunks[c]].copy() for i, c in moves]
      for (i, c), data in zip(moves, payload):
        j = (i + 1) % n
        buf[j, chunks[c]] = buf[j, chunks[c]] + data if phase == "reduce" else data
        sent[i] += 4 * len(chunks[c])
        received[j] += 4 * len(chunks[c])
  return buf, sent, received, steps


def _tree_allreduce(x: np.ndarray):
  """x [N, E]: reduce up the heap-ordered binary tree, then broadcast down. Counted like the ring."""
  n, e = x.shape
  buf = x.astype(np.float64).copy()
  sent, received = np.zeros(n), np.zeros(n)
  depth = [0] * n
  for i in range(1, n):
    depth[i] = depth[(i - 1) // 2] + 1
  for level in range(max(depth), 0, -1):  # up: every node of this level sends its partial sum
    for i in (i for i in range(n) if depth[i] == level):
      parent = (i - 1) // 2
      buf[parent] += buf[i]
      sent[i] += 4 * e
      received[parent] += 4 * e
  for level in range(1, max(depth) + 1):  # down
    for i in (i for i in range(n) if depth[i] == level):
      buf[i] = buf[(i - 1) // 2]
      sent[(i - 1) // 2] += 4 * e
      received[i] += 4 * e
  return buf, sent, received, 2 * max(depth)


@pytest.mark.parametrize("n,e", [(2, 10), (3, 7), (8, 17), (8, 64), (5, 1000)])
def test_ring_allreduce_formula_is_the_simulated_ring(n, e):
  x = np.random.default_rng(n * e).normal(size=(n, e))
  result, sent, received, steps = _ring_allreduce(x)
  np.testing.assert_allclose(result, np.broadcast_to(x.sum(0), x.shape), rtol=1e-12)  # the ring really reduced
  t = wire.allreduce(4 * e, n, "ring")
  assert t.sent == pytest.approx(sent.mean(), rel=1e-12) and t.received == pytest.approx(received.mean(), rel=1e-12)
  assert t.sent == pytest.approx(2 * (n - 1) / n * 4 * e)  # 1.75 copies at N = 8
  assert t.operand == 4 * e and t.messages == steps == 2 * (n - 1)
  # The formula's chunks are S/N bytes each; whole elements make the busiest worker's up to one element more.
  assert 0 <= sent.max() - t.max_sent <= 2 * (n - 1) * 4 and t.max_sent == t.sent


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16])
def test_tree_allreduce_formula_is_the_simulated_tree(n):
  e = 12
  x = np.random.default_rng(n).normal(size=(n, e))
  result, sent, received, steps = _tree_allreduce(x)
  np.testing.assert_allclose(result, np.broadcast_to(x.sum(0), x.shape), rtol=1e-12)
  t = wire.allreduce(4 * e, n, "tree")
  np.testing.assert_array_equal(sent, np.asarray(wire.tree_loads(n)) * 4 * e)
  assert t.sent == pytest.approx(sent.mean()) == pytest.approx(2 * (n - 1) / n * 4 * e)  # N − 1 edges, both ways
  assert t.received == pytest.approx(received.mean()) and t.max_sent == sent.max() == t.max_received
  assert t.messages == steps == 2 * int(math.log2(n))


def test_ring_allgather_and_reduce_scatter_formulas_are_the_simulated_rings():
  n, e = 8, 40
  x = np.random.default_rng(0).normal(size=(n, e))
  # The reduce-scatter and the all-gather are the two halves of the ring all-reduce above.
  _, sent, received, _ = _ring_allreduce(x)
  half = wire.reduce_scatter(4 * e, n)
  assert half.sent + wire.allgather(4 * e, n).sent == pytest.approx(sent.mean())
  assert half.sent == pytest.approx((n - 1) / n * 4 * e) and half.operand == 4 * e
  assert wire.allgather(4 * e, n).operand == 4 * e // n  # each worker's share


def _spec_traffic(kind, message_bytes, num_replicas, **rule):
  """(round, step) Traffic of `kind`'s own accounting (its spec's `wire`, noloco_jax/outer/methods/)."""
  outer = OuterConfig(kind=kind, rule=RuleConfig(**rule))
  return outer.spec.wire(message_bytes, num_replicas, outer)


def test_group_exchange_sends_one_message_per_other_member():
  for n in (2, 4, 8):
    groups = pairing.PairingSchedule(seed=3, num_replicas=8, group_size=n, mode="fresh").groups(0)
    sent, received = np.zeros(8), np.zeros(8)
    for shift in range(1, n):  # exchange.group_mean: one route per shift, every replica sends once
      for g, src in enumerate(pairing.sources_for_shift(groups, shift, 8)):
        sent[src] += 100
        received[g] += 100
    t = _spec_traffic("noloco", 100, 8, group_size=n)[0]
    assert t.sent == sent.mean() == sent.max() == t.received == received.max() == (n - 1) * 100 == t.operand


def test_epidemic_push_sends_s_copies_and_receives_s_on_average():
  s, n = 2, 8
  t = _spec_traffic("epidemic", 100, n, fanout=s, topology="local")[0]
  regular = wire.push(100, s, n, regular=True)
  most = 0
  for draw in range(200):
    targets = epidemic.draw_targets(seed=0, draw=draw, num_replicas=n, fanout=s, topology="local")
    received = np.bincount(targets.ravel(), minlength=n) * 100
    assert received.mean() == t.received == t.sent == s * 100  # every edge is one message
    most = max(most, received.max())
    oracle = np.bincount(epidemic.draw_targets(seed=0, draw=draw, num_replicas=n, fanout=s).ravel(), minlength=n)
    assert (oracle * 100 == regular.max_received).all()  # EL-Oracle: every replica receives exactly s
  assert s * 100 < most <= t.max_received == (n - 1) * 100  # EL-Local: the in-degree is random


def test_fsdp_step_is_two_gathers_and_a_reduce_scatter():
  s, n = 4 * 1000, 8
  full = wire.fsdp_step(s, n)
  assert full.sent == pytest.approx(3 * (n - 1) / n * s)  # 1.5 × DDP's ring all-reduce
  assert full.sent == pytest.approx(1.5 * _spec_traffic("ddp", s, n)[1].sent)
  assert full.operand == 2 * s // n + s
  kept = wire.fsdp_step(s, n, gathers=1)
  assert kept.sent == pytest.approx(wire.allreduce(s, n).sent)  # the same bytes as an all-reduce
  assert wire.fsdp_step(s, n, grad_bytes=2 * 1000).sent == pytest.approx((n - 1) / n * (2 * s + 2000))


def test_alpha_beta_times_are_the_closed_forms():
  s, a, b = 1e6, 1e-3, 8e-9
  for p in (2, 8, 64):
    assert wire.allreduce(s, p, "ring").seconds(a, b) == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * s * b)
    assert wire.allreduce(s, p, "tree").seconds(a, b) == pytest.approx(2 * math.log2(p) * (a + s * b))
  assert wire.permute(s).seconds(a, b) == pytest.approx(a + s * b)
  assert wire.permute(s, 3).seconds(a, b) == pytest.approx(3 * (a + s * b))


def test_kinds_without_an_exchange_send_nothing_and_bad_algorithms_are_named():
  assert _spec_traffic("ddp", 100, 8)[0] == _spec_traffic("none", 100, 8)[0] == wire.NOTHING
  assert _spec_traffic("diloco", 100, 8)[1] == _spec_traffic("none", 100, 8)[1] == wire.NOTHING
  assert wire.allreduce(100, 1).sent == 0
  with pytest.raises(ValueError, match="'butterfly' is not valid: one of ring | tree"):
    wire.allreduce(100, 8, "butterfly")


def test_a_checkpoint_from_before_the_wire_counts_is_filled_from_its_steps_and_rounds():
  loop = LoopState.from_record({"step": 8, "round": 3, "comm_bytes": 300, "history": {"eval": []},
                                "pending": {"steps": [], "metrics": [], "rounds": []}})
  assert loop.bytes_sent is None
  loop.fill_wire_bytes(wire.allreduce(100, 8), wire.permute(5))
  assert loop.bytes_sent == pytest.approx(3 * 175 + 8 * 5) and loop.bytes_received == loop.bytes_sent
  loop.fill_wire_bytes(wire.NOTHING, wire.NOTHING)  # counted already: left alone
  assert loop.bytes_sent == pytest.approx(3 * 175 + 8 * 5)


# ---- The compiled programs: each method's collectives, priced by the same formulas ----


@pytest.mark.parametrize("outer", [
    dict(kind="noloco"), dict(kind="noloco", group_size=4), dict(kind="gossip"),
    dict(kind="epidemic", fanout=2), dict(kind="epidemic_adam"),
    dict(kind="diloco"), dict(kind="diloco", allreduce_algorithm="tree"),
    dict(kind="ddp"), dict(kind="ddp", allreduce_algorithm="tree"),
    dict(kind="noloco", compression="int8"),
])
def test_each_methods_wire_bytes_are_its_compiled_collectives(outer):
  cfg = default.get_config("smoke")
  cfg.outer.update(outer)
  result = dryrun.analyse(cfg, dryrun.parse_topology("8x16GB"), vocab_size=257, include_eval=False)
  copy = 4 * result["num_params"]
  for key in ("per_round", "per_step"):
    formula, counted = result[f"wire_{key}_formula"], result.get(f"wire_{key}_counted")
    if counted is None:  # no round program (ddp, none)
      assert formula["sent"] == 0
      continue
    for field in ("sent", "received", "operand"):
      assert counted[field] == pytest.approx(formula[field], rel=1e-9), (key, field, counted, formula)
  assert result["wire_within_replica_per_step_counted"]["sent"] == 0  # one device per replica
  # And in units of one float32 model copy, as outer/wire.py's table says:
  expected_round = {"noloco": (outer.get("group_size", 2) - 1) * copy, "gossip": copy, "epidemic": 2 * copy,
                    "epidemic_adam": copy, "diloco": 2 * 7 / 8 * copy, "ddp": 0}[outer["kind"]]
  if outer.get("compression") != "int8":
    assert result["wire_per_round_formula"]["sent"] == pytest.approx(expected_round)
  if outer["kind"] == "ddp":
    assert result["wire_per_step_formula"]["sent"] == pytest.approx(2 * 7 / 8 * copy)


def test_fsdp_wire_bytes_are_its_compiled_all_gather_and_reduce_scatter():
  """A fully sharded step written out with the collectives FSDP uses: gather the parameters, reduce-scatter
  the gradients. Its compiled program's collectives, priced by hlo.wire_bytes, are wire.fsdp_step."""
  mesh = jax.make_mesh((8,), ("w",), axis_types=(jax.sharding.AxisType.Explicit,))
  d = 64

  def step(w_shard, x):
    w = jax.lax.all_gather(w_shard, "w", tiled=True)  # [d, d] from the 8 shards of [d/8, d]
    grad = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return jax.lax.psum_scatter(grad, "w", scatter_dimension=0, tiled=True)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("w"), P("w")), out_specs=P("w")))
  w = jax.ShapeDtypeStruct((d, d), jnp.float32, sharding=jax.NamedSharding(mesh, P("w")))
  x = jax.ShapeDtypeStruct((16, d), jnp.float32, sharding=jax.NamedSharding(mesh, P("w")))
  text = fn.lower(w, x).compile().as_text()
  counted = hlo_lib.wire_bytes(text, 8)["across"]
  formula = wire.fsdp_step(4 * d * d, 8, gathers=1)
  assert counted.sent.mean() == pytest.approx(formula.sent) and counted.received.mean() == pytest.approx(formula.received)
  assert counted.operand.mean() == formula.operand == 4 * d * d // 8 + 4 * d * d
  assert {op for op, _, _ in hlo_lib.collectives(text)} == {"all-gather", "reduce-scatter"}
