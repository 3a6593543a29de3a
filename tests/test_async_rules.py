"""The staleness-aware NoLoCo update (outer/async_rules.py, the method's merge, exchange.mean_of) against
NumPy, and its equal-progress arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import async_rules, exchange, methods

ALPHA, BETA, GAMMA, H = 0.5, 0.7, 0.9, 10


def _member(seed):
  rng = np.random.default_rng(seed)
  shapes = {"w": (3, 4), "b": (5,)}
  return tuple({k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(3))  # θ, φ, δ


def np_async_noloco(theta, phi, delta, progress, *, alpha, beta, gamma, inner_steps, decay):
  """float64, from the module docstring: the update of member 0 of a group (lists of per-member dicts)."""
  steps = np.asarray(progress, np.float64)
  q = np.exp(-decay * (steps.max() - steps) / inner_steps)
  w = q / q.sum()
  out_phi, out_delta = {}, {}
  for k in theta[0]:
    t = [x[k].astype(np.float64) for x in theta]
    p = [x[k].astype(np.float64) for x in phi]
    d0 = delta[0][k].astype(np.float64)
    weighted_progress = sum(w[j] * (t[j] - p[j]) for j in range(len(t)))
    weighted_phi = sum(w[j] * p[j] for j in range(len(t)))
    out_delta[k] = alpha * d0 + beta * weighted_progress + gamma * (weighted_phi - p[0])
    out_phi[k] = p[0] + out_delta[k]
  return out_phi, out_delta


def _method():
  outer = default.get_config().outer
  outer.rule.update(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA)
  return methods.make(outer)


def _async_update(method, theta, phi, delta, progress, decay):
  """Member 0's update after an exchange, as the asynchronous driver applies it (training/rounds/
  asynchronous.py): the group's messages weighted by staleness (equal weights: the lock-step mean), then the
  method's own merge. Lists of per-member dicts; each member a stack of one replica."""
  parts = method.parts
  one = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
  state = lambda i: TrainState(step=jnp.zeros((1,), jnp.int32), params=one(theta[i]), opt_state=(),
                               outer={"slow": one(phi[i]), "momentum": one(delta[i])})
  sent = [parts.message(state(i))[1:3] for i in range(len(theta))]  # (own, payload) of every member
  weights = async_rules.staleness_weights(progress, inner_steps=H, decay=decay)
  mean = parts.mean(sent[0][0], [payload for _, payload in sent[1:]], None if async_rules.equal(weights) else weights)
  new = parts.merge(state(0), mean, None)
  return jax.tree.map(lambda x: np.asarray(x)[0], (new.params, new.outer["slow"], new.outer["momentum"]))


@pytest.mark.parametrize("progress,decay", [([40, 30], np.log(2.0)), ([30, 40, 25], 0.3), ([7, 7, 7], 1.0)])
def test_update_matches_numpy(progress, decay):
  members = [_member(s) for s in range(len(progress))]
  theta, phi, delta = ([m[i] for m in members] for i in range(3))
  new_theta, new_phi, new_delta = _async_update(_method(), theta, phi, delta, progress, decay)
  ref_phi, ref_delta = np_async_noloco(theta, phi, delta, progress, alpha=ALPHA, beta=BETA, gamma=GAMMA,
                                       inner_steps=H, decay=decay)
  for k in ref_phi:
    np.testing.assert_allclose(new_phi[k], ref_phi[k], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(new_delta[k], ref_delta[k], rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(new_theta[k], new_phi[k])  # θ ← φ


@pytest.mark.parametrize("group_size", [2, 3])
@pytest.mark.parametrize("message_dtype", [jnp.float32, jnp.bfloat16])
def test_equal_progress_is_one_division_by_n_of_the_float32_sum(group_size, message_dtype):
  """With every member at the same step, the mean is the lock-step group mean's arithmetic: the float32 sum
  in the order own, then partners (received in message_dtype), one division by the constant n."""
  rng = np.random.default_rng(group_size)
  own = {"x": jnp.asarray(rng.normal(size=(1, 7)).astype(np.float32))}
  received = [{"x": jnp.asarray(rng.normal(size=(1, 7))).astype(message_dtype)} for _ in range(group_size - 1)]
  got = exchange.mean_of(own, received, lambda p: jax.tree.map(lambda c: c.astype(jnp.float32), p))
  total = own["x"]
  for r in received:
    total = total + r["x"].astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(total / group_size))


def test_zero_decay_ignores_progress():
  q = async_rules.staleness_weights([100, 10, 55], inner_steps=H, decay=0.0)
  np.testing.assert_array_equal(q, np.ones(3, np.float32))


def test_weights_halve_per_round_behind_with_decay_ln2():
  q = async_rules.staleness_weights([50, 40, 30, 50], inner_steps=H, decay=np.log(2.0))
  np.testing.assert_allclose(q, [1.0, 0.5, 0.25, 1.0], rtol=1e-6)


def test_every_member_computes_the_same_weighted_mean():
  """The weights depend on the group's progress only: each member, listing itself first, gets the same m."""
  rng = np.random.default_rng(3)
  messages = [{"x": rng.normal(size=(6,)).astype(np.float32)} for _ in range(3)]
  progress = [20, 35, 30]
  means = []
  for me in range(3):
    order = [me] + [j for j in range(3) if j != me]
    q = async_rules.staleness_weights([progress[j] for j in order], inner_steps=H, decay=0.5)
    ordered = [messages[j] for j in order]
    means.append(np.asarray(exchange.mean_of(ordered[0], ordered[1:], lambda c: c, q)["x"]))
  np.testing.assert_allclose(means[1], means[0], rtol=1e-6)
  np.testing.assert_allclose(means[2], means[0], rtol=1e-6)


@pytest.mark.parametrize("kwargs,field", [
    (dict(progress=[1, 2], inner_steps=0, decay=0.1), "outer.inner_steps=0"),
    (dict(progress=[1, 2], inner_steps=5, decay=-1.0), "outer.asynchronous.staleness_decay=-1.0"),
    (dict(progress=[1, -2], inner_steps=5, decay=0.1), "progress=[1, -2]"),
])
def test_bad_input_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")) as e:
    async_rules.staleness_weights(**kwargs)
  assert "\n" not in str(e.value)


def test_merged_progress_is_the_weighted_mean_and_exact_at_equal_progress():
  q = async_rules.staleness_weights([40, 30], inner_steps=H, decay=np.log(2.0))  # [1, 0.5]
  assert async_rules.merged_progress([40, 30], q) == pytest.approx((40 + 0.5 * 30) / 1.5)
  assert async_rules.merged_progress([120, 120, 120], np.ones(3, np.float32)) == 120.0
  assert async_rules.equal(np.ones(3)) and not async_rules.equal(q)
