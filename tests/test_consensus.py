"""The consensus model (outer/consensus.py) against NumPy, and its evaluation plug-in (training/plugins/consensus_eval.py)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax.io import data as data_lib
from noloco_jax.io import writers
from noloco_jax.outer import consensus
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.training import build as build_lib
from noloco_jax.training.loop_state import LoopState
from noloco_jax.training.plugins import consensus_eval


def _stacks(seed=0, n=4):
  rng = np.random.default_rng(seed)
  theta = {"a": rng.normal(size=(n, 3, 5)).astype(np.float32), "b": {"c": rng.normal(size=(n, 7)).astype(np.float32)}}
  phi = jax.tree.map(lambda x: (x + rng.normal(size=x.shape)).astype(np.float32), theta)
  return theta, phi


def test_consensus_is_the_replica_mean_of_phi_or_theta():
  theta, phi = _stacks()
  for source, stacked in (("slow", phi), ("theta", theta)):
    got = consensus.consensus_params(theta, phi, source)
    want = jax.tree.map(lambda x: np.mean(x.astype(np.float64), axis=0), stacked)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-7)
      assert g.dtype == np.float32
  # No slow weights (ddp, none): the mean of θ, whatever the source.
  np.testing.assert_allclose(consensus.consensus_params(theta, None, "slow")["a"], theta["a"].mean(0), rtol=1e-6)
  with pytest.raises(ValueError, match="consensus source='phi'; valid: slow, theta"):
    consensus.consensus_params(theta, phi, "phi")


def test_consensus_of_bfloat16_slow_weights_is_the_float32_mean_rounded_once_to_thetas_dtype():
  theta, phi = _stacks(1)
  phi16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), phi)
  got = consensus.consensus_params(theta, phi16)
  want = np.mean(np.asarray(phi16["a"], np.float64), axis=0)  # bf16 values, averaged exactly
  assert got["a"].dtype == np.float32  # θ's dtype
  np.testing.assert_allclose(np.asarray(got["a"]), want, rtol=1e-6)
  theta16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), theta)
  mean16 = consensus.consensus_params(theta16, None)["a"]
  assert mean16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(mean16, np.float32),
                                np.asarray(jnp.asarray(np.mean(np.asarray(theta16["a"], np.float32), 0), jnp.bfloat16), np.float32))


def test_consensus_loss_is_the_mean_of_the_models_batch_losses():
  def loss_fn(params, tokens, targets):  # any per-batch mean: the scale times the mean token id gap
    return params["w"] * jnp.mean((targets - tokens).astype(jnp.float32))
  batches = np.random.default_rng(0).integers(0, 50, size=(3, 2, 9)).astype(np.int32)
  got = consensus.consensus_loss(loss_fn, {"w": jnp.float32(0.5)}, batches)
  want = np.mean([0.5 * np.mean(b[:, 1:] - b[:, :-1]) for b in batches])
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


class _Capture(writers.MetricWriter):
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))


@pytest.mark.parametrize("num_devices", [8, 1])
def test_the_plugin_logs_the_consensus_loss_at_evaluation_steps(num_devices):
  cfg = default.get_config("smoke")
  cfg.num_devices = num_devices
  setup = build_lib.build(cfg)
  state = setup.init_state()
  # Replicas apart, as after some rounds: θ and φ of replica i shifted by seeded noise.
  rng = np.random.default_rng(3)
  noisy = lambda t: jax.tree.map(lambda x: x + 0.05 * rng.normal(size=x.shape).astype(np.float32), jax.device_get(t))
  theta, phi = noisy(state.params), noisy(state.outer["slow"])
  state = jax.device_put(state.replace(params=theta, outer={**jax.device_get(state.outer), "slow": phi}),
                         setup.state_shardings)
  batches = data_lib.make_eval_batches(setup.config.data, seed=0, vocab_size=setup.model.vocab_size)
  writer = _Capture()
  run = types.SimpleNamespace(setup=setup, state=state, writer=writer, loop=LoopState(),
                              eval_batches=jax.device_put(batches, mesh_lib.replicated(setup.mesh)))
  plugin = consensus_eval.ConsensusEval()
  plugin.start(run)  # a fresh run: the step-0 row
  for step in range(1, cfg.num_steps + 1):
    plugin.after_step(run, step, {})
    if plugin.barrier_due(run, step):
      plugin.at_barrier(run, step)
  plugin.end(run)
  assert [s for s, _ in writer.rows] == [0, 6, 12]  # eval_every=6 and the last step (smoke)
  # The reference: NumPy's mean of φ, scored by the model's own loss batch by batch.
  mean_phi = jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), 0).astype(np.float32), phi)
  want = np.mean([float(setup.model.loss(mean_phi, b[:, :-1], b[:, 1:])) for b in batches])
  got = writer.rows[0][1]
  np.testing.assert_allclose(got["eval/consensus_loss"], want, rtol=1e-5)
  np.testing.assert_allclose(got["eval/consensus_ppl"], np.exp(want), rtol=1e-5)
  # Of θ instead: another number, the same check.
  plugin_theta = consensus_eval.ConsensusEval(source="theta")
  plugin_theta.start(run)
  mean_theta = jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), 0).astype(np.float32), theta)
  want_theta = np.mean([float(setup.model.loss(mean_theta, b[:, :-1], b[:, 1:])) for b in batches])
  np.testing.assert_allclose(plugin_theta.evaluate(run)["eval/consensus_loss"], want_theta, rtol=1e-5)
  assert abs(want_theta - want) > 1e-4


def test_identical_replicas_have_a_consensus_loss_equal_to_eval_loss():
  cfg = default.get_config("smoke")
  setup = build_lib.build(cfg)
  state = setup.init_state()  # every replica starts bit-identical
  batches = jax.device_put(data_lib.make_eval_batches(setup.config.data, seed=0, vocab_size=setup.model.vocab_size),
                           mesh_lib.replicated(setup.mesh))
  run = types.SimpleNamespace(setup=setup, state=state, writer=_Capture(), eval_batches=batches, loop=LoopState())
  plugin = consensus_eval.ConsensusEval()
  plugin.start(run)
  per_replica = np.mean([np.asarray(setup.eval_step(state.params, b)) for b in batches], axis=0)
  np.testing.assert_allclose(plugin.evaluate(run)["eval/consensus_loss"], per_replica.mean(), rtol=1e-5)


def test_a_bad_source_is_one_line():
  with pytest.raises(ValueError, match=r"^consensus source='mean'; valid: slow, theta\.$"):
    consensus_eval.ConsensusEval(source="mean")
