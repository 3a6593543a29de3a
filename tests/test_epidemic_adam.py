"""The reference code's Epidemic Learning variant (outer.kind=epidemic_adam): NumPy, paths, bytes, config."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.inner import step as inner
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
import hlo_helpers  # pylint: disable=g-bad-import-order  (tests/hlo_helpers.py)

N = 8
LR, B1, B2, EPS = 3e-3, 0.9, 0.95, 1e-8


def _optimizer():
  inner_cfg = ml_collections.ConfigDict(default.get_config().inner)
  inner_cfg.update(optimizer="adam", lr=LR, b1=B1, b2=B2, eps=EPS, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1.0)
  return inner.make_optimizer(inner_cfg, 1000, clip=False)


def _method(group_size=2, message_dtype="float32"):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kind="epidemic_adam", rule=dict(group_size=group_size), codec=dict(message_dtype=message_dtype))
  return outer_lib.make(cfg, _optimizer())


def _state(seed):
  """N replicas of a two-leaf model whose Adam state has seen two random gradients."""
  rng = np.random.default_rng(seed)
  theta = {"w": rng.normal(size=(N, 6, 5)).astype(np.float32), "b": rng.normal(size=(N, 3)).astype(np.float32)}
  opt = _optimizer()

  def warm(params, g1, g2):
    s = opt.init(params)
    for g in (g1, g2):
      _, s = opt.update(g, s, params)
    return s

  grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), theta) for _ in range(2)]
  opt_state = jax.vmap(warm)(theta, *grads)
  return TrainState(step=np.full(N, 2, np.int32), params=theta, opt_state=opt_state, outer={"slow": theta})


def _run(method, state, key, route, num_devices=N):
  mesh = mesh_lib.make_mesh(N, num_devices)
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  new, _ = programs_lib.make_round_fn(method, mesh, key)(state, jnp.asarray(route))
  return jax.tree.map(np.asarray, new)


def _adam_moments(opt_state):
  """(mu, nu, count) of optax's scale_by_adam inside the chain (found by type, not by position)."""
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
  (adam,) = found
  return adam.mu, adam.nu, np.asarray(adam.count)


def np_round(state, groups):
  """From the definition, float64: group mean of θ, then one Adam step with g = θ − mean (constant lr)."""
  mu, nu, count = _adam_moments(state.opt_state)
  out = {}
  for k, x in state.params.items():
    x = x.astype(np.float64)
    mean = np.empty_like(x)
    for g in groups:
      mean[list(g)] = x[list(g)].mean(axis=0)
    g = x - mean
    m = B1 * np.asarray(mu[k], np.float64) + (1 - B1) * g
    v = B2 * np.asarray(nu[k], np.float64) + (1 - B2) * g * g
    t = (count + 1).reshape((N,) + (1,) * (x.ndim - 1))
    m_hat, v_hat = m / (1 - B1 ** t), v / (1 - B2 ** t)
    out[k] = x - LR * m_hat / (np.sqrt(v_hat) + EPS)
  return out


@pytest.mark.parametrize("group_size", [2, 4])
def test_epidemic_adam_round_matches_numpy(group_size):
  state = _state(group_size)
  schedule = pairing.PairingSchedule(seed=3, num_replicas=N, group_size=group_size, mode="fresh")
  key, route = schedule.plan(1, N)
  got = _run(_method(group_size), state, key, route)
  want = np_round(state, schedule.groups(1))
  for k in state.params:
    np.testing.assert_allclose(got.params[k], want[k], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got.outer["slow"][k], got.params[k])
  # The inner optimizer took one more step (its count), the inner step counter did not.
  assert (_adam_moments(got.opt_state)[2] == 3).all() and (got.step == 2).all()
  # A group that agrees has g = 0: Adam's first moment only decays, as the NumPy rule says.
  same = state.replace(params=jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape).copy(), state.params))
  moved, want = _run(_method(group_size), same, key, route), np_round(same, schedule.groups(1))
  for k in state.params:
    np.testing.assert_allclose(moved.params[k], want[k], rtol=2e-5, atol=2e-6)


def test_epidemic_adam_mesh_and_simulator_paths_agree():
  """The moves are the same values on every path; the Adam arithmetic after them is compiled per shape
  ([1, ...] per device vs [8, ...] on one), where XLA:CPU may vectorise differently: 1-ulp agreement."""
  state = _state(7)
  schedule = pairing.PairingSchedule(seed=1, num_replicas=N, group_size=2, mode="fresh")
  method = _method(2)
  results = {d: _run(method, state, *schedule.plan(4, d), num_devices=d) for d in (N, 4, 1)}
  for d in (4, 1):
    for a, b in zip(jax.tree.leaves(results[d]), jax.tree.leaves(results[N])):
      np.testing.assert_allclose(a, b, rtol=3e-7, atol=0)


@pytest.mark.parametrize("group_size,message_dtype", [(2, "float32"), (4, "bfloat16")])
def test_epidemic_adam_bytes_are_n_minus_1_models_in_the_compiled_program(group_size, message_dtype):
  state = _state(0)
  method = _method(group_size, message_dtype)
  mesh = mesh_lib.make_mesh(N, N)
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  key, route = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=group_size).plan(0, N)
  lowered = programs_lib.make_round_fn(method, mesh, key).lower(state, jnp.asarray(route))
  hlo = lowered.compile().as_text()
  counted = method.traffic({"w": jnp.zeros((6, 5)), "b": jnp.zeros((3,))}, N)[0].operand
  itemsize = 4 if message_dtype == "float32" else 2
  assert counted == (group_size - 1) * 33 * itemsize
  assert hlo_helpers.stablehlo_collective_bytes(lowered.as_text()) == counted  # what the program asks to send
  # Summed over the compiled (source, target) pairs; XLA:CPU widens bf16 collectives to f32 after
  # lowering (on GPU/TPU the compiled op stays bf16).
  assert hlo_helpers.permute_pair_bytes(hlo) == N * counted * (4 // itemsize)
  assert hlo_lib.all_collective_bytes(hlo).keys() == {"collective-permute"}  # no all-reduce


@pytest.mark.parametrize("update,field,value", [
    ({"rule": {"group_size": 3}}, "outer.rule.group_size", "3"),
    ({"rule": {"group_size": 4}, "pairing": "round_robin"}, "outer.pairing", "round_robin"),
    ({"codec": {"compression": "int8"}}, "outer.codec.compression", "int8"),
])
def test_epidemic_adam_bad_config_names_the_field(update, field, value):
  config = default.get_config("smoke")
  config.outer.update(kind="epidemic_adam", **update)
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.validate(config)
  assert field in str(err.value) and value in str(err.value)


def test_epidemic_adam_trains_and_pulls_replicas_together(tmp_path):
  """End to end through the loop: the loss falls and the replicas end closer than independent ones."""
  from noloco_jax.training import loop as train

  results = {}
  for kind in ("epidemic_adam", "none"):
    config = default.get_config("smoke")
    config.num_steps, config.eval_every, config.checkpoint_every = 12, 0, 0
    config.outer.update(kind=kind, inner_steps=3)
    results[kind] = train.train_and_evaluate(config, str(tmp_path / kind))
  el = results["epidemic_adam"]
  assert el["eval/loss"] < el["eval/loss_first"] - 0.5
  params = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(el["state"].params))
  assert el["comm/collective_operand_bytes_per_replica"] == 4 * params * 4  # 4 rounds × one float32 model (pairs)
  # The pull is weak (Adam-normalised, its moments dominated by the real gradients): 0.60× when written.
  assert el["replicas/weight_std"] < 0.8 * results["none"]["replicas/weight_std"]
