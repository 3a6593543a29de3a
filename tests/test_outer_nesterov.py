"""A new outer rule defined in this file alone: NoLoCo with Nesterov outer momentum.

Its rule, its catalogue entry (the spec) and its stability analysis are written here and nowhere else
(docs/adding_an_outer_rule.md walks through them). Registered, it runs lock-step, overlapped, compressed
and in the asynchronous schedule, each checked against a NumPy reference: a method whose round is given
in parts gets every codec, streaming overlap and the asynchronous schedule without being named anywhere
in the package.

The rule, for replica i in a random group G of n, with NoLoCo's message c = β·θ + (γ − β)·φ and
g_i = mean_G(c) − γ·φ_i (= β·mean_G(θ − φ) + γ·(mean_G φ − φ_i), NoLoCo's step):

    δ_i ← α·δ_i + g_i;   φ_i ← φ_i + α·δ_i + g_i;   θ_i ← φ_i

(heavy-ball NoLoCo steps φ_i ← φ_i + δ_i; Nesterov steps along the new momentum and the fresh step again).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax import training
from noloco_jax.asynchronous import job as job_lib
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.config.fields import fail
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import base, methods, pairing, stability, wire
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.training import build as build_lib
from noloco_jax.training.rounds.asynchronous import AsyncRounds
from test_compression import np_dense_roundtrip  # pylint: disable=g-bad-import-order

N, ALPHA, BETA, GAMMA = 8, 0.5, 0.7, 0.9
KIND = "noloco_nesterov"


# ---- The rule: one parameter leaf of φ and δ, in float32 ----


def nesterov_update(phi, delta, mean, *, alpha: float, gamma: float):
  g = mean - gamma * phi
  delta = alpha * delta + g
  return phi + alpha * delta + g, delta


def build(outer, optimizer=None):
  """The method: NoLoCo's message and exchange (outer/base.group_rule), this update."""
  del optimizer
  r = outer.rule
  return base.group_rule(outer.kind, beta=r.outer_lr, gamma=r.consensus_weight,
                         update=functools.partial(nesterov_update, alpha=r.outer_momentum, gamma=r.consensus_weight),
                         codec=base.make_codec(outer.codec), inflight=outer.overlap.steps > 0 and outer.schedule == "lockstep")


# ---- Its stability: the exact mean-square analysis of this update (docs/stability.md's method) ----


def nesterov_radius(alpha: float, gamma: float, group_size: int, num_replicas: int) -> float:
  """ρ of the cross-replica spread. With x = φ − mean φ, y = δ − mean δ and the round's averaging matrix A
  (no local progress): y' = γ(A − I)x + αy and x' = x + (1 + α)y' − αy, i.e. (x', y') = (B0 + B1 ⊗ A)(x, y)
  with the blocks below; the second moments then map as in outer/stability.py."""
  B0 = np.array([[1 - (1 + alpha) * gamma, alpha ** 2], [-gamma, alpha]])
  B1 = gamma * np.array([[1 + alpha, 0.0], [1.0, 0.0]])
  a = stability.averaging_shrink(group_size, num_replicas)
  L = np.kron(B0, B0) + a * (np.kron(B0, B1) + np.kron(B1, B0) + np.kron(B1, B1))
  return float(np.max(np.abs(np.linalg.eigvals(L))))


def analysed(outer, num_replicas: int):
  r = outer.rule
  if num_replicas < 2:  # one replica: no spread
    return None
  rho = nesterov_radius(r.outer_momentum, r.consensus_weight, r.group_size, num_replicas)
  if rho < 1:
    return None
  return methods.Unstable("outer.rule.consensus_weight", r.consensus_weight,
                          f"with α={r.outer_momentum:g}, γ={r.consensus_weight:g}, n={r.group_size}, N={num_replicas} "
                          f"the spread of Nesterov NoLoCo grows (spectral radius {rho:.3f} ≥ 1)", "Lower γ or α")


def check(outer, num_replicas: int) -> None:
  del num_replicas
  if not outer.rule.consensus_weight > 0:
    fail("outer.rule.consensus_weight", outer.rule.consensus_weight, "a number > 0")


# ---- Its catalogue entry ----

NESTEROV = methods.Spec(
    kind=KIND, build=build,
    wire=lambda message_bytes, n, outer: (wire.permute(message_bytes, outer.rule.group_size - 1), wire.NOTHING),
    reads=("outer_momentum", "outer_lr", "consensus_weight", "group_size", "inner_steps"),
    defaults=dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, group_size=2, inner_steps=50),
    not_in_paper="NoLoCo's", exchange=("message_dtype",), grouped=True, parts=True,
    schedule=lambda outer, seed, n: pairing.PairingSchedule(seed=seed, num_replicas=n, group_size=outer.rule.group_size,
                                                           mode=outer.pairing),
    check=check, stability=analysed)
methods.register(NESTEROV)


# ---- The NumPy reference (float64), from the equations above ----


def np_round(theta, phi, delta, groups, alpha=ALPHA, beta=BETA, gamma=GAMMA, sent=None):
  """(φ', δ') of one round; `sent`: what each replica's partners receive of its message c (default: c)."""
  new_phi, new_delta = {}, {}
  for k in theta:
    t, p, d = (x[k].astype(np.float64) for x in (theta, phi, delta))
    c = beta * t + (gamma - beta) * p
    s = c if sent is None else sent[k]
    nd, nphi = np.empty_like(d), np.empty_like(p)
    for group in groups:
      for i in group:
        mean = (c[i] + sum(s[j] for j in group if j != i)) / len(group)  # own term exact, the others as sent
        g = mean - gamma * p[i]
        nd[i] = alpha * d[i] + g
        nphi[i] = p[i] + alpha * nd[i] + g
    new_phi[k], new_delta[k] = nphi, nd
  return new_phi, new_delta


def _replicas(seed, shapes=(("w", (6, 5)), ("b", (3,)))):
  rng = np.random.default_rng(seed)
  theta = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in shapes}
  phi = {k: v + 0.1 * rng.normal(size=v.shape).astype(np.float32) for k, v in theta.items()}
  delta = {k: 0.05 * rng.normal(size=v.shape).astype(np.float32) for k, v in theta.items()}
  return theta, phi, delta


def _outer(**sections):
  outer = default.get_config().outer
  outer.kind = KIND
  outer.rule.update(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA)
  outer.update(sections)
  return outer


def _state(method, mesh, theta, phi, delta, **extra):
  outer = {**jax.vmap(method.init)(theta), "slow": phi, "momentum": delta, **extra}
  state = TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=outer)
  return jax.device_put(state, mesh_lib.replica_sharding(mesh))


def _close(got, want, atol=2e-6):
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-6, atol=atol)


@pytest.mark.parametrize("group_size,num_devices", [(2, N), (4, 4), (2, 1)])
def test_lockstep_rounds_match_numpy(group_size, num_devices):
  """Two lock-step rounds (message, routes, merge: outer/programs.py) on a mesh and on one device."""
  method = methods.make(_outer(rule=dict(group_size=group_size)))
  mesh = mesh_lib.make_mesh(N, num_devices)
  schedule = pairing.PairingSchedule(seed=1, num_replicas=N, group_size=group_size, mode="fresh")
  programs = programs_lib.RoundPrograms(method, mesh, schedule)
  assert programs.split  # run in parts: only the routes depend on the grouping
  theta, phi, delta = _replicas(0)
  state = _state(method, mesh, theta, phi, delta)
  for round_ in range(2):
    round_fn, route = programs(round_)
    state, _ = round_fn(state, route)
    phi, delta = np_round(theta, phi, delta, schedule.groups(round_))
    _close(state.outer["slow"], phi)
    _close(state.outer["momentum"], delta)
    _close(state.params, phi)  # θ ← φ
    theta = {k: v + 0.3 for k, v in jax.tree.map(np.asarray, state.params).items()}  # some local progress
    state = state.replace(params=jax.device_put(theta, mesh_lib.replica_sharding(mesh)))


def test_an_overlapped_round_matches_numpy():
  """Streaming overlap (outer.overlap): the exchange in flight while θ moves on, then the delayed merge
  θ ← λ·θ_local + (1 − λ)·φ_new with φ and δ from the round's start."""
  mix = 0.3
  method = methods.make(_outer(overlap=dict(steps=1, mix=mix)))
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=2, num_replicas=N, group_size=2, mode="fresh")
  programs = programs_lib.RoundPrograms(method, mesh, schedule, where="exchange", mix=mix)
  theta, phi, delta = _replicas(1)
  state = _state(method, mesh, theta, phi, delta)
  key, route = programs.plan(0)
  state, sent, _ = programs.jitted("message", programs_lib.abstract(state))(state)
  mean = programs.jitted(key)(*sent, route)  # in flight
  moved = jax.tree.map(lambda x: x + 0.25, state.params)  # the τ inner steps meanwhile
  state = state.replace(params=moved, outer={**state.outer, base.INFLIGHT: mean})
  state = programs.jitted("merge")(state)
  want_phi, want_delta = np_round(theta, phi, delta, schedule.groups(0))
  _close(state.outer["slow"], want_phi)
  _close(state.outer["momentum"], want_delta)
  _close(state.params, {k: mix * (theta[k].astype(np.float64) + 0.25) + (1 - mix) * want_phi[k] for k in theta})


def test_a_compressed_round_matches_numpy():
  """int8 messages with error feedback (outer.codec): what a partner receives is the quantised c + e."""
  chunk = 16
  method = methods.make(_outer(codec=dict(compression="int8", chunk=chunk)))
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=3, num_replicas=N, group_size=2, mode="fresh")
  theta, phi, delta = _replicas(2)
  residual = {k: 0.01 * np.ones_like(v) for k, v in theta.items()}
  state = _state(method, mesh, theta, phi, delta, residual=residual)
  round_fn, route = programs_lib.RoundPrograms(method, mesh, schedule)(0)
  state, _ = round_fn(state, route)
  sent, new_residual = {}, {}
  for k in theta:
    c = BETA * theta[k].astype(np.float64) + (GAMMA - BETA) * phi[k]
    m = c + residual[k]
    sent[k] = np.stack([np_dense_roundtrip(m[i], 8, chunk) for i in range(N)])
    new_residual[k] = m - sent[k]  # feedback_decay 1
  want_phi, want_delta = np_round(theta, phi, delta, schedule.groups(0), sent=sent)
  _close(state.outer["slow"], want_phi, atol=1e-5)
  _close(state.outer["momentum"], want_delta, atol=1e-5)
  _close(state.outer["residual"], new_residual, atol=1e-5)


def test_an_asynchronous_round_matches_numpy():
  """The asynchronous schedule's round (training/rounds/asynchronous.py), as a process of a two-process job
  applies it: its message, the staleness-weighted mean with what its partner sent, its merge."""
  config = default.get_config("smoke")
  config.num_replicas, config.outer.kind, config.outer.schedule = 2, KIND, "async"
  config.outer.rule.update(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA)
  setup = build_lib.build(job_lib.process_config(config_lib.load(config)))
  state = setup.init_state()
  rng = np.random.default_rng(4)
  noisy = lambda tree, scale: jax.tree.map(lambda x: x + scale * rng.normal(size=x.shape).astype(x.dtype), tree)
  place = lambda s: jax.device_put(s, setup.state_shardings)
  mine = place(state.replace(params=noisy(state.params, 0.02),
                             outer={**state.outer, "momentum": noisy(state.outer["momentum"], 0.01)}))
  partner = place(state.replace(params=noisy(state.params, 0.02)))
  theirs = setup.method.parts.message(partner)[2]  # what the partner's transport delivers
  copy = lambda s: jax.tree.map(np.asarray, s)
  before, partner_np = copy(mine), copy(partner)

  class Process:
    slot = 0
  c = setup.config
  driver = AsyncRounds(setup.method, setup.mesh, setup.state_shardings, setup.fragments, c.outer, seed=c.seed,
                       last_step=c.num_steps, process=Process())
  driver._compile_ahead(mine)  # pylint: disable=protected-access  (what its `start` does)
  sent, _, codec_state = driver._compiled["message"](mine)  # pylint: disable=protected-access
  result = session_lib.RoundResult("exchanged", 0, (0, 1), (0, 0), [sent[-1], theirs], [60, 57])  # one round behind
  mean, progress = driver._combine(sent[0], result)  # pylint: disable=protected-access
  new = driver._compiled["merge"](mine, mean, codec_state)  # pylint: disable=protected-access
  driver.programs.close()
  H = config.outer.inner_steps
  q = np.exp(-config.outer.asynchronous.staleness_decay * np.array([0.0, 3.0]) / H)  # weights, own first
  for path, leaf in jax.tree_util.tree_flatten_with_path(before.params)[0]:
    get = lambda tree: functools.reduce(lambda node, key: node[key.key], path, tree)
    t, p, d = (get(x)[0].astype(np.float64) for x in (before.params, before.outer["slow"], before.outer["momentum"]))
    c_mine = BETA * t + (GAMMA - BETA) * p
    c_theirs = BETA * get(partner_np.params)[0] + (GAMMA - BETA) * get(partner_np.outer["slow"])[0]
    g = (q[0] * c_mine + q[1] * c_theirs) / q.sum() - GAMMA * p
    nd = ALPHA * d + g
    np.testing.assert_allclose(np.asarray(get(new.outer["momentum"]))[0], nd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(get(new.outer["slow"]))[0], p + ALPHA * nd + g, rtol=1e-5, atol=1e-6)
  assert progress == pytest.approx((q[0] * 60 + q[1] * 57) / q.sum())


def test_its_stability_analysis_predicts_the_spread_and_refuses_an_unstable_rule():
  """The analysis against the rule itself, in NumPy: the mean square of the spread of φ over many runs with
  their own fresh random pairs (no local progress) changes by ρ per round in the long run; load refuses an
  unstable γ unless allowed."""
  trials, rounds = 2000, 40
  for alpha, gamma in ((0.5, 0.7), (0.9, 1.6)):
    rho = nesterov_radius(alpha, gamma, 2, N)
    rng = np.random.default_rng(5)
    phi, delta = rng.normal(size=(trials, N)), np.zeros((trials, N))
    mean_square = []
    for _ in range(rounds):
      order = rng.permuted(np.broadcast_to(np.arange(N), (trials, N)), axis=1)  # each trial its own pairs
      partner = np.empty_like(order)
      np.put_along_axis(partner, order[:, 0::2], order[:, 1::2], axis=1)
      np.put_along_axis(partner, order[:, 1::2], order[:, 0::2], axis=1)
      c = gamma * phi  # θ = φ: c = β·φ + (γ − β)·φ
      g = (c + np.take_along_axis(c, partner, axis=1)) / 2 - gamma * phi
      delta = alpha * delta + g
      phi = phi + alpha * delta + g
      mean_square.append(np.mean((phi - phi.mean(1, keepdims=True)) ** 2))
    measured = (mean_square[-1] / mean_square[-11]) ** (1 / 10)
    assert measured == pytest.approx(rho, rel=0.05), (alpha, gamma, measured, rho)
    assert (rho < 1) == (mean_square[-1] < mean_square[0])
  config = default.get_config("smoke")
  config.outer.kind = KIND
  config.outer.rule.update(outer_momentum=0.9, consensus_weight=1.6)
  with pytest.raises(config_lib.ConfigError, match=r"^config.outer.rule.consensus_weight=1.6 is not valid: .*Nesterov"):
    config_lib.load(config)
  config.outer.allow_unstable = True
  assert config_lib.load(config).outer.kind == KIND


def test_it_trains_overlapped_and_compressed_end_to_end(tmp_path):
  """Through train_and_evaluate with every ability at once: int8 messages, streaming overlap; the loss falls,
  the bytes are its spec's, and the summary names its values as the run set them."""
  config = default.get_config("smoke")
  config.outer.kind = KIND
  config.outer.update(codec=dict(compression="int8"), overlap=dict(steps=1))
  result = training.train_and_evaluate(config, str(tmp_path))
  assert result["eval/loss"] < result["eval/loss_first"]
  assert result["outer/kind"] == KIND and result["outer"]["outer_momentum"] == 0.5
  assert "overlap τ=1" in result["text"] and "int8" in result["text"]


def test_no_file_of_the_package_names_it():
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "noloco_jax")
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name)) as f:
          assert KIND not in f.read(), os.path.join(folder, name)
