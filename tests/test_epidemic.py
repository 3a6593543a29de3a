"""Epidemic Learning (outer.kind=epidemic): graphs, the round against NumPy, mesh = simulator, bytes."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.outer import epidemic
from noloco_jax.outer import methods as outer_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.outer import rounds as rounds_lib
from noloco_jax.inner.state import TrainState

N = 8


def _method(fanout, message_dtype="float32"):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kind="epidemic", fanout=fanout, message_dtype=message_dtype)
  return outer_lib.make_method(cfg)


def _round(method, pool, index, theta, num_devices=N):
  mesh = mesh_lib.make_mesh(N, num_devices)
  state = TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer={"slow": theta})
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  new, _ = rounds_lib.make_round_fn(method, mesh, pool)(state, jnp.int32(index))
  return jax.tree.map(np.asarray, new)


def np_epidemic(theta, targets):
  """Reference from the definition: own model plus every model sent to me, plain average (float64)."""
  out = {}
  for k, x in theta.items():
    total, count = x.astype(np.float64).copy(), np.ones(N)
    for i in range(N):
      for t in targets[i]:
        total[t] += x[i]
        count[t] += 1
    out[k] = total / count.reshape((N,) + (1,) * (x.ndim - 1))
  return out


def _theta(seed):
  rng = np.random.default_rng(seed)
  return {"w": rng.normal(size=(N, 6, 5)).astype(np.float32), "b": rng.normal(size=(N, 3)).astype(np.float32)}


def test_matchings_cover_every_edge_once_and_are_partial_permutations():
  for draw in range(20):
    targets = epidemic.draw_targets(0, draw, N, 3)
    assert all(len(set(row)) == 3 and i not in row for i, row in enumerate(targets))
    graph = epidemic.matchings(targets)
    edges = sorted((src, g) for m in graph for g, src in enumerate(m) if src >= 0)
    assert edges == sorted((i, int(t)) for i in range(N) for t in targets[i])
    for m in graph:
      senders = [s for s in m if s >= 0]
      assert len(senders) == len(set(senders))  # each sender at most once per ppermute


def test_targets_are_uniform_and_in_degree_is_binomial():
  """Over 4000 draws, s = 2, N = 8: each (sender, receiver ≠ sender) pair has frequency s/(N−1), and the
  in-degree follows Binomial(N−1, s/(N−1)) (mean s, variance s(1 − s/(N−1)))."""
  s, draws = 2, 4000
  counts = np.zeros((N, N))
  indeg = []
  for d in range(draws):
    targets = epidemic.draw_targets(1, d, N, s)
    for i in range(N):
      counts[i, targets[i]] += 1
    indeg.extend(np.bincount(targets.ravel(), minlength=N))
  p = s / (N - 1)
  assert np.all(np.diag(counts) == 0)
  off = counts[~np.eye(N, dtype=bool)] / draws
  assert np.abs(off - p).max() < 4 * np.sqrt(p * (1 - p) / draws)  # 4 standard errors
  indeg = np.asarray(indeg)
  assert abs(indeg.mean() - s) < 1e-9  # every edge lands somewhere: exactly s on average
  var = s * (1 - p)
  assert abs(indeg.var() - var) < 0.05 * var
  assert abs(np.mean(indeg == 0) - (1 - p) ** (N - 1)) < 0.01  # P(nobody sends to me)


@pytest.mark.parametrize("fanout", [1, 3])
def test_epidemic_round_matches_numpy(fanout):
  theta = _theta(fanout)
  targets = epidemic.draw_targets(5, 0, N, fanout)
  got = _round(_method(fanout), (epidemic.matchings(targets),), 0, theta)
  want = np_epidemic(theta, targets)
  for k in theta:
    np.testing.assert_allclose(got.params[k], want[k], atol=1e-6)
    np.testing.assert_array_equal(got.outer["slow"][k], got.params[k])


def test_epidemic_mesh_and_simulator_paths_agree_bitwise():
  theta = _theta(3)
  schedule = epidemic.EpidemicSchedule(seed=2, num_replicas=N, fanout=2, mode="fresh")
  method = _method(2)
  results = {}
  for d in (N, 4, 1):
    key, route = schedule.plan(3, d)
    results[d] = _round(method, key, int(route), theta, num_devices=d)
  for d in (4, 1):
    for k in theta:
      np.testing.assert_array_equal(results[d].params[k], results[N].params[k])


@pytest.mark.parametrize("fanout", [1, 3])
def test_epidemic_bytes_are_fanout_models_in_the_compiled_program(fanout):
  theta = _theta(0)
  method = _method(fanout)
  mesh = mesh_lib.make_mesh(N, N)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer={"slow": theta}),
                         mesh_lib.replica_sharding(mesh))
  graph = epidemic.matchings(epidemic.draw_targets(0, 0, N, fanout))
  hlo = rounds_lib.make_round_fn(method, mesh, (graph,)).lower(state, jnp.int32(0)).compile().as_text()
  counted = method.bytes_per_round({k: v[0] for k, v in theta.items()})
  assert counted == fanout * (30 + 3) * 4
  # Summed over devices, the (source, target) pairs of the compiled permutes carry N·s models.
  assert hlo_lib.permute_pair_bytes(hlo) == N * counted
  assert hlo_lib.all_collective_bytes(hlo).keys() == {"collective-permute"}


def test_epidemic_training_saves_and_resumes_exactly(tmp_path, caplog, compile_cache):
  """End to end through the loop and the checkpoint (whose record holds the schedule's fan-out and graph)."""
  del compile_cache  # the resumed run reuses the first one's programs (tests/conftest.py)
  import os
  import shutil

  from noloco_jax.training import loop as train

  config = default.get_config("smoke")
  config.num_steps, config.checkpoint_every = 6, 3
  config.outer.update(kind="epidemic", fanout=2)
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  with caplog.at_level("INFO"):
    second = train.train_and_evaluate(config, workdir)
  assert "resumed from step 3" in caplog.text
  params = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(first["state"].params))
  assert first["comm/collective_operand_bytes_per_replica"] == 2 * 2 * params * 4  # 2 rounds × fanout 2 × float32 model
  for a, b in zip(jax.tree.leaves(first["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
