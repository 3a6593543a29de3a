"""A new outer rule defined in this file alone: docs/adding_an_outer_rule.md's example, registered at run
time, trains, checkpoints, resumes and grows elastically without a change to any file of the package.

The rule ("mix"): every replica's slow weights move to a mix of its fast weights and its group's mean,
    φ_i ← (1 − λ)·θ_i + λ·mean_G θ,   θ_i ← φ_i,
with λ = outer.rule.outer_lr and the groups of the pairing schedule (outer.rule.group_size).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax import training
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import base, exchange, methods, pairing, wire
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib

N = 8


def mix_update(theta, mean_theta, *, mix: float):
  """φ ← (1 − mix)·θ + mix·mean_G θ in float32; returns (θ, φ) with θ = φ (the pure rule, step 1)."""
  new = jax.tree.map(lambda t, m: ((1 - mix) * t.astype(jnp.float32) + mix * m).astype(t.dtype), theta, mean_theta)
  return new, new


def build_mix(outer, optimizer) -> base.OuterMethod:
  """The method (step 3): state, round, message; everything else (elastic grow from the slow weights,
  storage dtype, offload, compile-ahead, checkpoints) comes from the interface."""
  del optimizer
  mix, dtype = outer.rule.outer_lr, base.MESSAGE_DTYPES[outer.codec.message_dtype]

  def make_round(pool, num_devices):
    def round_fn(states: TrainState, route):
      metrics = {"pseudo_grad_norm": base.pseudo_grad_norm(states)}
      mean = exchange.plain_group_mean(states.params, pool, route, num_devices, dtype)
      theta, phi = mix_update(states.params, mean, mix=mix)
      return states.replace(params=theta, outer={"slow": phi}), metrics
    return round_fn

  return base.OuterMethod(kind=outer.kind, init=lambda params: {"slow": params}, make_round=make_round,
                          new_replica=base.from_slow, message_bytes=lambda params: base.tree_bytes(params, dtype))


# Its catalogue entry: what it reads (λ = outer.rule.outer_lr, n, H), its bytes (n − 1 messages a round), the
# groups it averages within; its stability is not analysed (the log says so).
MIX = methods.Spec(kind="mix", build=build_mix, wire=lambda message_bytes, n, outer: (
    wire.permute(message_bytes, outer.rule.group_size - 1), wire.NOTHING), reads=("outer_lr", "group_size", "inner_steps"),
                   defaults=dict(outer_lr=0.5, group_size=2, inner_steps=50), not_in_paper="this test's choice",
                   exchange=("message_dtype",), grouped=True,
                   schedule=lambda outer, seed, n: pairing.PairingSchedule(seed=seed, num_replicas=n,
                                                                          group_size=outer.rule.group_size,
                                                                          mode=outer.pairing))
methods.register(MIX)


def np_mix(theta, groups, mix):
  """The equation again, in float64, replica by replica (step 2: from the equation, not the code)."""
  out = {}
  for k, t in theta.items():
    t = t.astype(np.float64)
    new = np.empty_like(t)
    for group in groups:
      for i in group:
        new[i] = (1 - mix) * t[i] + mix * t[list(group)].mean(0)
    out[k] = new
  return out


def _config(**outer):
  config = default.get_config("smoke")
  config.outer.kind = "mix"
  config.outer.update(outer)
  return config


@pytest.mark.parametrize("group_size,num_devices", [(2, N), (4, 4), (2, 1)])
def test_the_rule_defined_here_matches_numpy(group_size, num_devices):
  method = methods.make(_config(rule=dict(group_size=group_size, outer_lr=0.4)).outer)
  rng = np.random.default_rng(0)
  theta = {"w": rng.normal(size=(N, 6, 5)).astype(np.float32), "b": rng.normal(size=(N, 3)).astype(np.float32)}
  schedule = pairing.PairingSchedule(seed=2, num_replicas=N, group_size=group_size, mode="fresh")
  mesh = mesh_lib.make_mesh(N, num_devices)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=method.init(theta)),
                         mesh_lib.replica_sharding(mesh))
  key, route = schedule.plan(3, num_devices)
  new, metrics = programs_lib.make_round_fn(method, mesh, key)(state, route)
  want = np_mix(theta, schedule.groups(3), 0.4)
  for k in theta:
    np.testing.assert_allclose(np.asarray(new.params[k]), want[k], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new.outer["slow"][k]), np.asarray(new.params[k]))
  assert np.asarray(metrics["pseudo_grad_norm"]).shape == (N,)


def test_the_rule_defined_here_trains_resumes_and_grows(tmp_path, compile_cache):
  """End to end through train_and_evaluate: the loss falls, the bytes are the rule's, the pairings are
  logged, a resume is exact, and an elastic grow makes the new replicas from their peers' slow weights."""
  del compile_cache
  config = _config(rule=dict(outer_lr=0.5))
  config.checkpoint_every, config.checkpoint.keep = 6, 3
  workdir = str(tmp_path / "run")
  first = training.train_and_evaluate(config, workdir)
  assert first["eval/loss"] < first["eval/loss_first"]
  params = jax.tree.map(lambda x: x[0], first["state"].params)
  # 12 steps / H = 3: 4 rounds, n = 2: one copy out and one in per round, on the wire and in the ppermutes.
  for figure in ("bytes_sent", "bytes_received", "collective_operand_bytes"):
    assert first[f"comm/{figure}_per_replica"] == 4 * base.tree_bytes(params), figure
  with open(os.path.join(workdir, "pairings.jsonl")) as f:
    assert [json.loads(line)["round"] for line in f] == [0, 1, 2, 3]
  # Exact resume from step 6 (the step-12 checkpoint removed).
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
  second = training.train_and_evaluate(config, workdir)
  for a, b in zip(jax.tree.leaves(first["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Elastic grow from the step-12 checkpoint to 10 replicas: replicas 8, 9 start from peers' φ.
  grown_dir = str(tmp_path / "grown")
  shutil.copytree(workdir, grown_dir)
  grow = _config(rule=dict(outer_lr=0.5))
  grow.num_replicas, grow.num_steps, grow.checkpoint.elastic = 10, 15, "grow"
  grown = training.train_and_evaluate(grow, grown_dir)
  with open(os.path.join(grown_dir, "elastic.jsonl")) as f:
    event = json.loads(f.readline())
  assert event["replicas_before"] == 8 and event["replicas_after"] == 10 and len(event["added_from"]) == 2
  assert np.isfinite(grown["eval/loss"])


def test_an_unregistered_kind_is_one_line_naming_the_field():
  from noloco_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = _config()
  config.outer.kind = "mixx"
  with pytest.raises(config_lib.ConfigError, match=r"^config\.outer\.kind='mixx' is not valid: one of .*mix"):
    config_lib.load(config)
