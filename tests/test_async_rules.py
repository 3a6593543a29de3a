"""The staleness-aware NoLoCo update (outer/async_rules.py) against NumPy, and against the synchronous rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.outer import async_rules, rules

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


@pytest.mark.parametrize("progress,decay", [([40, 30], np.log(2.0)), ([30, 40, 25], 0.3), ([7, 7, 7], 1.0)])
def test_update_matches_numpy(progress, decay):
  members = [_member(s) for s in range(len(progress))]
  theta, phi, delta = ([m[i] for m in members] for i in range(3))
  messages = [rules.noloco_message(t, p, beta=BETA, gamma=GAMMA) for t, p in zip(theta, phi)]
  new_theta, new_phi, new_delta = async_rules.async_noloco_update(
      phi[0], delta[0], messages, progress, alpha=ALPHA, gamma=GAMMA, inner_steps=H, decay=decay)
  ref_phi, ref_delta = np_async_noloco(theta, phi, delta, progress, alpha=ALPHA, beta=BETA, gamma=GAMMA,
                                       inner_steps=H, decay=decay)
  for k in ref_phi:
    np.testing.assert_allclose(np.asarray(new_phi[k]), ref_phi[k], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(new_delta[k]), ref_delta[k], rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(new_theta[k]), np.asarray(new_phi[k]))  # θ ← φ


@pytest.mark.parametrize("group_size", [2, 3])
@pytest.mark.parametrize("message_dtype", [jnp.float32, jnp.bfloat16])
def test_equal_progress_is_the_synchronous_rule_bit_for_bit(group_size, message_dtype):
  """With every member at the same step, the update is rules.noloco_update of exchange.group_mean's mean:
  float32 sum in the order own, then partners, one division by n; received messages in message_dtype."""
  members = [_member(10 + s) for s in range(group_size)]
  theta, phi, delta = ([m[i] for m in members] for i in range(3))
  messages = [rules.noloco_message(t, p, beta=BETA, gamma=GAMMA) for t, p in zip(theta, phi)]
  sent = [messages[0]] + [jax.tree.map(lambda c: c.astype(message_dtype), m) for m in messages[1:]]
  total = jax.tree.map(lambda c: c.astype(jnp.float32), messages[0])
  for m in sent[1:]:
    total = jax.tree.map(lambda t, r: t + r.astype(jnp.float32), total, m)
  sync_mean = jax.tree.map(lambda t: t / group_size, total)
  want = rules.noloco_update(phi[0], delta[0], sync_mean, alpha=ALPHA, gamma=GAMMA)
  got = async_rules.async_noloco_update(phi[0], delta[0], sent, [120] * group_size, alpha=ALPHA, gamma=GAMMA,
                                        inner_steps=H, decay=0.7)
  for w_tree, g_tree in zip(want, got):
    for k in w_tree:
      np.testing.assert_array_equal(np.asarray(g_tree[k]), np.asarray(w_tree[k]))


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
    means.append(np.asarray(async_rules.weighted_mean([messages[j] for j in order], q)["x"]))
  np.testing.assert_allclose(means[1], means[0], rtol=1e-6)
  np.testing.assert_allclose(means[2], means[0], rtol=1e-6)


@pytest.mark.parametrize("kwargs,field", [
    (dict(progress=[1, 2], inner_steps=0, decay=0.1), "outer.inner_steps=0"),
    (dict(progress=[1, 2], inner_steps=5, decay=-1.0), "outer.staleness_decay=-1.0"),
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
