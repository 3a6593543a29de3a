"""Outer steps against NumPy references, pairings, the mesh and simulator paths, and bytes on the wire."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.outer import methods as outer_lib
from noloco_jax.training import build as build_lib
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import pairing
from noloco_jax.inner.state import TrainState
import hlo_helpers  # pylint: disable=g-bad-import-order  (tests/hlo_helpers.py)

N = 8


def _outer_cfg(**kw):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kw)
  return cfg


def _random_replicas(seed, *, same_phi=False):
  """Random θ, φ, δ for N replicas of a small two-leaf model, float32 NumPy."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (3, 4), "b": (5,)}
  theta = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in shapes.items()}
  phi = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in shapes.items()}
  if same_phi:
    phi = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in phi.items()}
  delta = {k: 0.1 * rng.normal(size=(N,) + s).astype(np.float32) for k, s in shapes.items()}
  return theta, phi, delta


def _run_round(method, groups_pool, index, theta, outer_state, num_devices=N):
  mesh = mesh_lib.make_mesh(N, num_devices)
  sharding = mesh_lib.replica_sharding(mesh)
  state = TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=outer_state)
  state = jax.device_put(state, sharding)
  round_fn = programs_lib.make_round_fn(method, mesh, groups_pool)
  new_state, metrics = round_fn(state, jnp.asarray(index, jnp.int32))
  return jax.tree.map(np.asarray, new_state), jax.tree.map(np.asarray, metrics)


# ---- NumPy references (float64), written from docs/method.md §1, not from the implementation ----


def np_noloco(theta, phi, delta, groups, alpha, beta, gamma):
  new_theta, new_phi, new_delta = {}, {}, {}
  for k in theta:
    t, p, d = (x[k].astype(np.float64) for x in (theta, phi, delta))
    nd, np_ = np.empty_like(d), np.empty_like(p)
    for group in groups:
      g = list(group)
      mean_local_progress = (t[g] - p[g]).mean(0)
      mean_phi = p[g].mean(0)
      for i in g:
        nd[i] = alpha * d[i] + beta * mean_local_progress + gamma * (mean_phi - p[i])  # +β: corrected sign
        np_[i] = p[i] + nd[i]
    new_theta[k], new_phi[k], new_delta[k] = np_.copy(), np_, nd
  return new_theta, new_phi, new_delta


def np_diloco(theta, phi, momentum_buf, lr, mu, nesterov):
  """Outer SGD on g = φ − mean θ (φ identical on all replicas); returns (θ, φ, buffer)."""
  new_phi, new_buf = {}, {}
  for k in theta:
    g = phi[k].astype(np.float64) - theta[k].astype(np.float64).mean(0, keepdims=True)
    buf = mu * momentum_buf[k] + g
    step = g + mu * buf if nesterov else buf
    new_phi[k] = phi[k] - lr * step
    new_buf[k] = buf
  return new_phi, new_phi, new_buf


# ---- One round of each kind against NumPy ----


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_noloco_round_matches_numpy(group_size):
  theta, phi, delta = _random_replicas(0)
  method = outer_lib.make(_outer_cfg(kind="noloco", rule=dict(group_size=group_size, outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9)))
  groups = pairing.groups_from_permutation(np.random.default_rng(1).permutation(N), group_size)
  state, metrics = _run_round(method, (groups,), 0, theta, {"slow": phi, "momentum": delta})
  want_theta, want_phi, want_delta = np_noloco(theta, phi, delta, groups, 0.5, 0.7, 0.9)
  for k in theta:
    np.testing.assert_allclose(state.params[k], want_theta[k], atol=1e-6)
    np.testing.assert_allclose(state.outer["slow"][k], want_phi[k], atol=1e-6)
    np.testing.assert_allclose(state.outer["momentum"][k], want_delta[k], atol=1e-6)
  want_norm = np.sqrt(sum(((theta[k] - phi[k]).astype(np.float64).reshape(N, -1) ** 2).sum(1) for k in theta))
  np.testing.assert_allclose(metrics["pseudo_grad_norm"], want_norm, rtol=1e-6)


def test_gossip_round_is_pairwise_averaging_of_fast_weights():
  theta, phi, delta = _random_replicas(2)
  method = outer_lib.make(_outer_cfg(kind="gossip", rule=dict(outer_momentum=0.9, outer_lr=0.1, consensus_weight=0.1)))  # ignored
  groups = ((0, 5), (1, 2), (3, 7), (4, 6))
  state, _ = _run_round(method, (groups,), 0, theta, {"slow": phi, "momentum": delta})
  for k in theta:
    for a, b in groups:
      want = (theta[k][a].astype(np.float64) + theta[k][b]) / 2
      np.testing.assert_allclose(state.params[k][a], want, atol=1e-6)
      np.testing.assert_allclose(state.params[k][b], want, atol=1e-6)


@pytest.mark.parametrize("nesterov,lr,mu", [(False, 0.7, 0.3), (True, 0.7, 0.9)])
def test_diloco_two_rounds_match_numpy(nesterov, lr, mu):
  theta, phi, _ = _random_replicas(3, same_phi=True)
  method = outer_lib.make(_outer_cfg(kind="diloco", rule=dict(outer_lr=lr, outer_momentum=mu, nesterov=nesterov)))
  outer_state = jax.vmap(method.init)({k: jnp.asarray(v) for k, v in phi.items()})
  buf = {k: np.zeros_like(v[:1], np.float64) for k, v in phi.items()}
  want_phi = phi
  for round_ in range(2):
    state, _ = _run_round(method, ((),), 0, theta, outer_state)
    _, want_phi, buf = np_diloco(theta, want_phi, buf, lr, mu, nesterov)
    for k in theta:
      np.testing.assert_allclose(state.params[k], np.broadcast_to(want_phi[k], theta[k].shape), atol=1e-6)
    outer_state = state.outer
    theta = {k: v + np.random.default_rng(10 + round_).normal(size=v.shape).astype(np.float32)
             for k, v in state.params.items()}


def test_ddp_averages_gradients_over_all_replicas():
  method = outer_lib.make(_outer_cfg(kind="ddp"))
  mesh = mesh_lib.make_mesh(N, 4)  # two replicas per device: local mean, then the all-reduce
  grads = {"w": np.random.default_rng(4).normal(size=(N, 3, 2)).astype(np.float32)}
  reduce = jax.jit(mesh_lib.replica_map(method.reduce_grads, mesh, in_specs=jax.P(mesh_lib.REPLICA),
                                        out_specs=jax.P(mesh_lib.REPLICA)))
  got = np.asarray(reduce(grads)["w"])
  np.testing.assert_allclose(got, np.broadcast_to(grads["w"].mean(0), got.shape), atol=1e-6)


def test_noloco_with_one_group_and_identical_slow_weights_equals_heavy_ball_diloco():
  theta, phi, _ = _random_replicas(5, same_phi=True)
  alpha, beta = 0.3, 0.7
  nl = outer_lib.make(_outer_cfg(kind="noloco", rule=dict(group_size=N, outer_momentum=alpha, outer_lr=beta, consensus_weight=beta)))
  dl = outer_lib.make(_outer_cfg(kind="diloco", rule=dict(outer_momentum=alpha, outer_lr=beta, nesterov=False)))
  nl_outer = {"slow": phi, "momentum": jax.tree.map(np.zeros_like, phi)}
  dl_outer = jax.vmap(dl.init)({k: jnp.asarray(v) for k, v in phi.items()})
  one_group = (tuple(range(N)),)
  for round_ in range(3):  # three rounds, so the momentum terms are exercised
    nl_state, _ = _run_round(nl, (one_group,), 0, theta, nl_outer)
    dl_state, _ = _run_round(dl, ((),), 0, theta, dl_outer)
    for k in theta:
      np.testing.assert_allclose(nl_state.params[k], dl_state.params[k], rtol=0, atol=2e-6)
    nl_outer, dl_outer = nl_state.outer, dl_state.outer
    theta = {k: v + 0.5 * np.random.default_rng(20 + round_).normal(size=v.shape).astype(np.float32)
             for k, v in nl_state.params.items()}


def test_gossip_with_zero_learning_rate_keeps_the_mean_and_shrinks_the_spread():
  theta, phi, delta = _random_replicas(6)
  method = outer_lib.make(_outer_cfg(kind="gossip"))
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  outer_state = {"slow": theta, "momentum": delta}
  mean0 = {k: v.astype(np.float64).mean(0) for k, v in theta.items()}
  spreads = []
  for round_ in range(6):  # inner lr 0: θ stays at φ between rounds
    theta, _ = _run_round(method, (schedule.groups(round_),), 0, theta, outer_state)
    outer_state, theta = theta.outer, theta.params
    for k in theta:
      np.testing.assert_allclose(theta[k].mean(0), mean0[k], atol=1e-6)
    spreads.append(float(np.sqrt(sum(((v - v.mean(0)) ** 2).sum() for v in theta.values()))))
  assert all(b < a for a, b in zip(spreads, spreads[1:])), spreads


# ---- Mesh path vs single-device simulator ----


@pytest.mark.parametrize("kind,num_devices", [("noloco", 4), ("noloco", 2), ("gossip", 4), ("diloco", 4)])
def test_mesh_and_simulator_paths_agree(kind, num_devices):
  theta, phi, delta = _random_replicas(7, same_phi=(kind == "diloco"))
  codec = dict(message_dtype="bfloat16") if kind != "diloco" else {}  # DiLoCo sends no message in a chosen dtype
  method = outer_lib.make(_outer_cfg(kind=kind, rule=dict(group_size=2), codec=codec))
  schedule = pairing.PairingSchedule(seed=3, num_replicas=N, group_size=2, mode="round_robin")
  outer_state = ({"slow": phi, "momentum": delta} if kind != "diloco"
                 else jax.tree.map(np.asarray, jax.vmap(method.init)({k: jnp.asarray(v) for k, v in phi.items()})))
  index = schedule.index(4)
  results = {d: _run_round(method, schedule.pool, index, theta, outer_state, num_devices=d)[0]
             for d in (N, num_devices, 1)}
  # One device with the grouping as data (the simulator's program for every round and mode).
  results["table"] = _run_round(method, None, pairing.source_table(schedule.groups(4)), theta, outer_state,
                                num_devices=1)[0]
  for d in (num_devices, 1, "table"):
    for k in theta:
      if kind == "diloco":  # the all-reduce may sum in another order than the one-device mean
        np.testing.assert_allclose(results[d].params[k], results[N].params[k], atol=1e-6)
      else:  # only values move; the arithmetic is identical, so the results are bitwise equal
        np.testing.assert_array_equal(results[d].params[k], results[N].params[k])


# ---- Pairings ----


def test_pairings_partition_the_replicas_into_groups_of_n():
  for n in (2, 4, 8):
    schedule = pairing.PairingSchedule(seed=0, num_replicas=16, group_size=n, mode="fresh")
    for round_ in range(10):
      groups = schedule.groups(round_)
      assert all(len(g) == n for g in groups)
      assert sorted(r for g in groups for r in g) == list(range(16))


def test_pairings_differ_across_rounds_and_are_reproducible_across_hosts():
  for mode, distinct in (("fresh", 10), ("round_robin", 5)):
    a = pairing.PairingSchedule(seed=7, num_replicas=8, group_size=2, mode=mode)
    b = pairing.PairingSchedule(seed=7, num_replicas=8, group_size=2, mode=mode)  # "another host"
    rounds_a = [a.groups(t) for t in range(20)]
    assert rounds_a == [b.groups(t) for t in range(20)]
    assert len(set(rounds_a)) >= distinct, mode  # re-drawn (round_robin: among its 7 matchings)
  c = pairing.PairingSchedule(seed=8, num_replicas=8, group_size=2, mode="fresh")
  assert [c.groups(t) for t in range(5)] != [a.groups(t) for t in range(5)]
  fixed = pairing.PairingSchedule(seed=7, num_replicas=8, group_size=2, mode="fixed")
  assert len({fixed.groups(t) for t in range(5)}) == 1


def test_sources_for_shift_visit_every_other_group_member_once():
  groups = ((3, 1, 6, 0), (2, 7, 5, 4))
  seen = {g: set() for g in range(8)}
  for shift in (1, 2, 3):
    for g, s in enumerate(pairing.sources_for_shift(groups, shift, 8)):
      seen[g].add(s)
  for group in groups:
    for g in group:
      assert seen[g] == set(group) - {g}


# ---- Communication: bytes counted from the pytree equal the compiled collectives ----


@pytest.mark.parametrize("kind,message_dtype,group_size", [("noloco", "float32", 2), ("noloco", "bfloat16", 2),
                                                            ("noloco", "float32", 4), ("diloco", "float32", 2)])
def test_counted_bytes_match_the_compiled_collectives(kind, message_dtype, group_size):
  theta, phi, delta = _random_replicas(8, same_phi=True)
  method = outer_lib.make(_outer_cfg(kind=kind, rule=dict(group_size=group_size), codec=dict(message_dtype=message_dtype)))
  mesh = mesh_lib.make_mesh(N, N)
  groups = pairing.groups_from_permutation(np.arange(N), group_size)
  outer_state = {"slow": phi, "momentum": delta} if kind != "diloco" else jax.vmap(method.init)(phi)
  state = TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=outer_state)
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  lowered = programs_lib.make_round_fn(method, mesh, (groups,)).lower(state, jnp.int32(0))
  hlo = lowered.compile().as_text()
  counted = method.traffic(jax.tree.map(lambda x: x[0], theta), N)[0].operand
  permuted, reduced = hlo_lib.collective_bytes(hlo, "collective-permute"), hlo_lib.collective_bytes(hlo, "all-reduce")
  itemsize = 2 if message_dtype == "bfloat16" else 4
  if kind == "noloco":
    assert counted == (group_size - 1) * 17 * itemsize  # 17 parameters, n−1 messages per round
    assert hlo_helpers.stablehlo_collective_bytes(lowered.as_text()) == counted and reduced == 0
    # XLA:CPU widens bf16 collectives to f32 after lowering; on GPU/TPU the compiled op stays bf16.
    assert permuted == counted * (4 // itemsize)
  else:
    assert reduced == counted == 17 * 4 and permuted == 0


# ---- Compilation: one program per pooled or single-device run; fresh compiles ahead ----


@pytest.mark.parametrize("mode,num_devices", [("round_robin", 0), ("fresh", 0), ("fresh", 1)])
def test_outer_rounds_compile_once_per_pairing_program(mode, num_devices):
  cfg = default.get_config("smoke")
  cfg.outer.pairing, cfg.num_devices = mode, num_devices
  setup = build_lib.build(cfg, vocab_size=257)
  state = setup.init_state()
  routes = []
  for round_ in range(6):
    round_fn, route = setup.rounds(round_)
    state, _ = round_fn(state, route)
    routes.append(np.asarray(route).tobytes())
  programs = setup.rounds  # NoLoCo runs in parts: message and merge, one program each
  assert programs.jitted("message")._cache_size() == 1 and programs.jitted("merge")._cache_size() == 1
  if mode == "round_robin" or num_devices == 1:
    assert len(setup.rounds) == 1  # one routes program for all six rounds
    assert len(set(routes)) > 1  # ... yet the rounds used different pairings
  else:  # one routes program (the grouping's ppermutes alone) per grouping
    assert len(setup.rounds) == len({setup.schedule.groups(r) for r in range(6)})


def test_compiled_ahead_rounds_equal_jitted_rounds():
  """The run's programs (AOT, compiled in the background) are Setup.rounds': bitwise equal states."""
  cfg = default.get_config("smoke")
  setup = build_lib.build(cfg, vocab_size=257)
  a = setup.init_state()
  b = setup.init_state()
  programs = setup.rounds
  programs.start(a)
  try:
    for round_ in range(3):
      compiled, route = programs.program(round_)
      a, _ = programs_lib.lockstep_round(compiled)(a, route)
      jitted, route_b = setup.rounds(round_)
      b, _ = jitted(b, route_b)
      assert np.array_equal(route, route_b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stats = programs.stats
    # Rounds 0-2 waited for at most once each (for their routes, the message and the merge together);
    # the message and merge compiled once, rounds 0-2's routes each once; round 3's may still be compiling.
    assert len(stats.waits_s) == 3 and stats.compiles >= 5 and len(programs._futures) == 6
  finally:
    programs.close()
