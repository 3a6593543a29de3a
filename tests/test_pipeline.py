"""Pipeline stages and random routing: the schedule against a host reference, routing properties,
NoLoCo training with 2 stages × 4 replicas on 8 fake devices, and a checkpoint round-trip.

Tolerance of the equality tests: float32 everywhere, rtol 2e-5 / atol 2e-6 on losses and rtol 1e-4 /
atol 1e-6 on gradients; the pipelined and reference programs sum the same terms in different orders
(per micro-batch, then over slots), which is all that separates them.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from noloco_jax.inner import step as inner
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax import models
from noloco_jax.models import llama as model_lib
from noloco_jax.models import losses
from noloco_jax.parallel import pipeline
from noloco_jax.parallel import routing
from noloco_jax import training
from noloco_jax.training import build as build_lib
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel.mesh import REPLICA, STAGE

VOCAB = 257


def _weight_std_numpy(params_NxP) -> float:
  """metrics.weight_std's NumPy reference: the std over replicas, pooled over every parameter, in float64."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params_NxP)]
  n, count = leaves[0].shape[0], sum(x[0].size for x in leaves)
  return float(np.sqrt(sum(((x - x.mean(0)) ** 2).sum() for x in leaves) / (n * count)))


def _config(num_replicas=4, num_stages=2, routing_mode="fixed", **pipeline_kw):
  cfg = default.get_config("smoke")
  cfg.num_replicas, cfg.num_stages = num_replicas, num_stages
  cfg.model.num_layers = 2 * num_stages  # two layers per stage: the layer slice is a real slice
  cfg.data.batch_size = 4
  cfg.pipeline.routing = routing_mode
  for key, value in pipeline_kw.items():
    cfg.pipeline[key] = value
  return cfg


def _distinct_params(setup, seed=1):
  """[N, ...] params with a different perturbation per replica, so that a routing mix-up shows."""
  params = jax.tree.map(np.asarray, setup.init_state().params)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (x + 0.05 * rng.normal(size=x.shape)).astype(x.dtype), params)


def _reference_loss(params_N, tokens_NxBxL1, paths_MxNxS, model_cfg):
  """Σ over replicas g and micro-batches m of loss(m, g) / M, each micro-batch run along its path.

  Written from the definition, without pipeline.py: stage s of micro-batch (m, g) uses the layers
  of replica paths[m, g, s], the embedding is g's, the head that of the last replica on the path.
  All M·N paths run side by side (vmap), with each path's parameters gathered by replica index.
  Also returns the loss scored on each replica's last stage, the quantity the pipeline reports.
  """
  M, N, S = paths_MxNxS.shape
  llama = model_lib.Llama(model_cfg)
  per_stage = model_cfg.num_layers // S
  layers = model_lib.Layers(model_cfg, per_stage)
  b = tokens_NxBxL1.shape[1] // M
  paths = paths_MxNxS.reshape(M * N, S)  # row m·N + g
  tokens = tokens_NxBxL1.reshape(N, M, b, -1).transpose(1, 0, 2, 3).reshape(M * N, b, -1)
  pick = lambda tree, rows: jax.tree.map(lambda x: x[rows], tree)
  x = jax.vmap(lambda p, t: llama.apply({"params": {"embed": p}}, t, method=model_lib.Llama.embed_tokens))(
      pick(params_N["embed"], paths[:, 0]), tokens[:, :, :-1])
  for s in range(S):
    stage = jax.tree.map(lambda a: a[paths[:, s], s * per_stage:(s + 1) * per_stage], params_N["layers"])
    x = jax.vmap(lambda p, h: layers.apply({"params": p}, h))(stage, x)
  last = paths[:, S - 1]
  ends = {"final_norm": pick(params_N["final_norm"], last), "head": pick(params_N["head"], last)}
  logits = jax.vmap(lambda p, h: llama.apply({"params": p}, h, method=model_lib.Llama.logits))(ends, x)
  loss = jax.vmap(losses.cross_entropy)(logits, tokens[:, :, 1:]) / M
  return jnp.sum(loss), jax.ops.segment_sum(loss, last, num_segments=N)


def _routes(config, mode=None):
  return pipeline.route_schedule(config.pipeline, seed=config.seed, num_replicas=config.num_replicas,
                                 num_stages=config.num_stages, batch_size=config.data.batch_size, mode=mode)


def _pipelined_grads(setup, schedule, params_N, tokens, step):
  """loss [N] and gradients [N, ...] of pipeline.make_grads_fn on the mesh, routed by `schedule`."""
  cfg, mesh = setup.config, setup.mesh
  S = mesh.shape[STAGE]
  grads_fn = pipeline.make_grads_fn(setup.model, mesh, schedule)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_N)
  specs = pipeline._manual_specs(params_N, S, 1, setup.model)  # pylint: disable=protected-access
  fn = jax.jit(jax.shard_map(functools.partial(grads_fn, global_shapes=shapes), mesh=mesh,
                             in_specs=(specs, P(REPLICA), P(REPLICA)), out_specs=(P(REPLICA), specs),
                             axis_names={REPLICA, STAGE}))
  shardings = pipeline.state_shardings(params_N, mesh, setup.model)
  steps = np.full((cfg.num_replicas,), step, np.int32)
  loss, grads = fn(jax.device_put(params_N, shardings), sharding_lib.global_array(mesh, tokens, cfg.num_replicas),
                   jax.device_put(steps, mesh_lib.replica_sharding(mesh)))
  return np.asarray(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def grads_setup():
  """4 replicas × 2 stages (two layers each), 2 micro-batches of 2 sequences, distinct replicas."""
  cfg = _config(routing_mode="random", microbatches=2)
  setup = build_lib.build(cfg, vocab_size=VOCAB)
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(4, 4, 33)).astype(np.int32)
  return setup, _distinct_params(setup), tokens


# ---- the schedule equals the definition ----


def test_fixed_routing_equals_the_unpipelined_model(grads_setup):
  setup, params, tokens = grads_setup
  schedule = _routes(setup.config, "fixed")
  loss, grads = _pipelined_grads(setup, schedule, params, tokens, step=5)
  plain = jax.jit(jax.vmap(lambda p, b: inner.compute_grads(p, b, setup.model.loss)))
  plain_loss, plain_grads = plain(params, tokens)
  np.testing.assert_allclose(loss, plain_loss, rtol=2e-5, atol=2e-6)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    ref = functools.reduce(lambda t, k: t[k.key], path, plain_grads)
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_chunked_loss_on_the_last_stage_equals_the_unpipelined_plain_loss(grads_setup):
  """model.loss_chunk reaches the pipeline's last stage (Llama.head_loss): same loss and gradients."""
  setup, params, tokens = grads_setup
  cfg = _config(routing_mode="random", microbatches=2)
  cfg.model.loss_chunk = 12  # does not divide L = 32: the padded last chunk is exercised too
  chunked = build_lib.build(cfg, vocab_size=VOCAB)
  loss, grads = _pipelined_grads(chunked, _routes(chunked.config, "fixed"), params, tokens, step=5)
  plain_loss, plain_grads = jax.jit(jax.vmap(lambda p, b: inner.compute_grads(p, b, setup.model.loss)))(params, tokens)
  np.testing.assert_allclose(loss, plain_loss, rtol=2e-5, atol=2e-6)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    ref = functools.reduce(lambda t, k: t[k.key], path, plain_grads)
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_random_routing_equals_the_routed_reference(grads_setup):
  """Loss per last-stage replica and every gradient shard, against the paths of routing.py."""
  setup, params, tokens = grads_setup
  schedule = _routes(setup.config)
  step = 5
  loss, grads = _pipelined_grads(setup, schedule, params, tokens, step)
  paths = schedule.paths(step)
  assert not np.all(paths == paths[:, :, :1]), "random routing never left a replica"
  ref_fn = jax.jit(jax.value_and_grad(lambda p: _reference_loss(p, tokens, paths, setup.model.config), has_aux=True))
  (_, ref_scored), ref_grads = ref_fn(params)
  np.testing.assert_allclose(loss, ref_scored, rtol=2e-5, atol=2e-6)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    ref = functools.reduce(lambda t, k: t[k.key], path, ref_grads)
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# ---- routing ----


def test_random_routes_are_balanced_reproducible_and_change_across_steps():
  N, S, M = 8, 4, 6
  schedule = routing.RouteSchedule(seed=3, num_replicas=N, num_stages=S, num_microbatches=M)
  for step in range(20):
    paths = schedule.paths(step)
    assert (paths[:, :, 0] == np.arange(N)).all()  # every micro-batch starts in its own replica
    for m in range(M):
      for s in range(S):  # each replica of a stage gets exactly one micro-batch of each index m
        assert sorted(paths[m, :, s]) == list(range(N))
    for b in range(S - 1):
      for m in range(M):
        assert sorted(schedule.permutation(step, m, b)) == list(range(N))
  again = routing.RouteSchedule(seed=3, num_replicas=N, num_stages=S, num_microbatches=M)
  other = routing.RouteSchedule(seed=4, num_replicas=N, num_stages=S, num_microbatches=M)
  assert all((schedule.paths(t) == again.paths(t)).all() for t in range(20))
  assert any((schedule.paths(t) != other.paths(t)).any() for t in range(20))
  assert len({schedule.paths(t).tobytes() for t in range(20)}) == 20  # the route changes from step to step
  # The traced table is the host's, bit for bit.
  steps = np.arange(50, dtype=np.int32)
  traced = np.asarray(jax.jit(jax.vmap(schedule.indices_traced))(steps))
  assert all((traced[t] == schedule.indices(int(t))).all() for t in steps)
  fixed = routing.RouteSchedule(seed=3, num_replicas=N, num_stages=S, num_microbatches=M, mode="fixed")
  assert (fixed.paths(7) == np.arange(N)[None, :, None]).all()


@pytest.mark.parametrize("num_replicas,num_stages", [(8, 2), (2, 4)])  # k = 2 per device; S = 4
def test_router_delivers_what_the_schedule_says(num_replicas, num_stages):
  """On the mesh (also with k = 2 replicas per device), each slot's ppermutes match the host table."""
  devices = jax.devices()[:8]
  mesh = mesh_lib.make_mesh(num_replicas, 0, devices=devices, stages=num_stages)
  D = mesh.shape[REPLICA]
  k = num_replicas // D
  M = 3
  schedule = routing.RouteSchedule(seed=0, num_replicas=num_replicas, num_stages=num_stages, num_microbatches=M)
  router = routing.make_slot_router(schedule, D)
  T = M + num_stages - 1

  def local(step):
    s = jax.lax.axis_index(STAGE)
    g = jax.lax.axis_index(REPLICA) * k + jnp.arange(k)
    label = (g * 100 + s).astype(jnp.int32)  # who sent it: replica, stage
    table = schedule.indices_traced(step)
    return jnp.stack([router(label, jnp.int32(t), table) for t in range(T)], axis=1)[:, :, None]

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(REPLICA, None, STAGE),
                             axis_names={REPLICA, STAGE}))
  step = 11
  got = np.asarray(fn(jnp.int32(step)))  # [N, T, S]: what (replica, stage) received in slot t
  table = schedule.indices(step)
  for t in range(T):
    for b in range(num_stages - 1):
      m = min(max(t - b, 0), M - 1)  # bubble slots use the clipped micro-batch's draw
      dest = schedule.family.member(table[m, b])
      for g in range(num_replicas):
        assert got[dest[g], t, b + 1] == g * 100 + b, (t, b, g)
    assert (got[:, t, 0] == 0).all()  # stage 0 receives nothing


# ---- training, outer steps and checkpoints with stages ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """NoLoCo, 2 stages × 4 replicas on the 8 fake devices, smoke sizes (two layers), random routing."""
  cfg = default.get_config("smoke")
  cfg.num_replicas, cfg.num_stages = 4, 2
  cfg.model.num_layers = 2
  workdir = str(tmp_path_factory.mktemp("pipeline_noloco"))
  return cfg, workdir, training.train_and_evaluate(cfg, workdir)


def test_noloco_with_two_stages_trains(trained):
  cfg, workdir, result = trained
  assert result["eval/loss"] < result["eval/loss_first"] - 0.2, result["text"]
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  train_rows = [r for r in rows if "train/loss" in r]
  rounds = cfg.num_steps // cfg.outer.inner_steps
  # A replica's message is the sum over its stages of their shards: one model per round.
  assert train_rows[-1]["comm/collective_operand_bytes_per_replica"] == rounds * result["model/num_params"] * 4
  assert result["replicas/weight_std"] > 0
  state = result["state"]
  layer_leaf = state.params["layers"]["blocks"]["mlp"]["up"]["kernel"]
  assert layer_leaf.sharding.spec[:2] == (REPLICA, STAGE)  # the layer axis stayed split over stages
  np.testing.assert_allclose(float(jax.jit(metrics_lib.weight_std)(state.params)),
                             _weight_std_numpy(mesh_lib.fetch(state.params)), rtol=1e-4)


def test_checkpoint_round_trip_with_stages(trained):
  """The run saved its last step; running the same config again restores it (nothing left to train)."""
  cfg, workdir, result = trained
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(cfg.num_steps)))
  again = training.train_and_evaluate(cfg, workdir)
  for a, b in zip(jax.tree.leaves(result["state"]), jax.tree.leaves(again["state"])):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(mesh_lib.fetch(a), mesh_lib.fetch(b))
  assert again["eval/loss"] == result["eval/loss"]
  # The state keeps the unpipelined tree, so the same checkpoint also restores without stages.
  cfg_flat = cfg.copy_and_resolve_references()
  cfg_flat.num_stages = 1
  flat = training.train_and_evaluate(cfg_flat, workdir)
  for a, b in zip(jax.tree.leaves(result["state"]), jax.tree.leaves(flat["state"])):
    assert STAGE not in str(b.sharding.spec)
    np.testing.assert_array_equal(mesh_lib.fetch(a), mesh_lib.fetch(b))


def test_outer_round_sends_one_model_per_replica_with_stages(grads_setup):
  """Bytes in the compiled round's collective-permutes = the accounting (no end leaf sent S times)."""
  from noloco_jax.tools import hlo  # pylint: disable=g-import-not-at-top
  setup = grads_setup[0]
  assert setup.method.kind == "noloco"
  # One grouping (no switch over a pool, whose branches would all be counted).
  round_fn = programs_lib.make_round_fn(setup.method, setup.mesh, (setup.schedule.groups(0),), setup.state_shardings)
  state = setup.init_state()
  text = round_fn.lower(state, jnp.int32(0)).compile().as_text()
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  per_device = hlo.collective_bytes(text, "collective-permute")
  # Each device sends its stage's shards; the two stages of a replica together send one model.
  assert per_device * setup.config.num_stages == setup.method.traffic(one, setup.config.num_replicas)[0].operand
  # No parameter is stored whole on every stage (it would be sent S times per round).
  on_every_stage = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
                    if not any(e == STAGE or (isinstance(e, tuple) and STAGE in e) for e in x.sharding.spec)]
  assert on_every_stage == []


@pytest.mark.parametrize("mode", ["per_stage", "global"])
def test_gradient_clipping_per_stage_or_global(mode):
  """Synthetic gradients of the four roles; the group of stage s = its layers + the ends it owns."""
  mesh = mesh_lib.make_mesh(4, 0, devices=jax.devices()[:8], stages=2)
  rng = np.random.default_rng(0)
  grads = {"embed": {"embedding": rng.normal(size=(4, 6, 4))}, "layers": {"w": rng.normal(size=(4, 2, 3))},
           "final_norm": {"scale": rng.normal(size=(4, 3))},  # no even dimension: replicated over stages
           "head": {"kernel": rng.normal(size=(4, 4, 5))}}
  scale = np.asarray([0.1, 0.5, 2.0, 4.0])  # replicas 0, 1 below the threshold, 2, 3 above
  grads = jax.tree.map(lambda x: (x * scale.reshape((4,) + (1,) * (x.ndim - 1))).astype(np.float32), grads)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), grads)
  model = models.get("llama").from_preset("tiny", vocab_size=8, seq_len=8)  # its roles: embed, layers, final_norm + head
  specs = pipeline._manual_specs(grads, 2, 1, model)  # pylint: disable=protected-access
  max_norm = 4.0

  def local(g):
    roles = pipeline.roles(shapes, model)
    dims = pipeline._stage_dims(shapes, 2, 1, model)  # pylint: disable=protected-access
    group_sq = pipeline._group_sq_norms(g, roles, dims, 2)  # pylint: disable=protected-access
    return pipeline._clip(g, roles, group_sq, max_norm, mode, 2), group_sq  # pylint: disable=protected-access

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=(specs, P(REPLICA)),
                             axis_names={REPLICA, STAGE}))
  clipped, group_sq = jax.tree.map(np.asarray, fn(jax.device_put(grads, pipeline.state_shardings(grads, mesh, model))))

  sq = lambda x: (x.astype(np.float64) ** 2).reshape(4, -1).sum(1)
  expected_sq = np.stack([sq(grads["layers"]["w"][:, :1]) + sq(grads["embed"]["embedding"]),
                          sq(grads["layers"]["w"][:, 1:]) + sq(grads["final_norm"]["scale"]) + sq(grads["head"]["kernel"])], 1)
  np.testing.assert_allclose(group_sq, expected_sq, rtol=1e-5)
  norms = np.sqrt(expected_sq.sum(1, keepdims=True)) if mode == "global" else np.sqrt(expected_sq)
  factor = np.where(norms < max_norm, 1.0, max_norm / norms)  # [N, 1] or [N, S]
  f = lambda s: factor[:, min(s, factor.shape[1] - 1)]
  expect = {"embed": {"embedding": grads["embed"]["embedding"] * f(0)[:, None, None]},
            "layers": {"w": grads["layers"]["w"] * np.stack([f(0), f(1)], 1)[:, :, None]},
            "final_norm": {"scale": grads["final_norm"]["scale"] * f(1)[:, None]},
            "head": {"kernel": grads["head"]["kernel"] * f(1)[:, None, None]}}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), clipped, expect)
  assert (factor < 1).any() and (factor == 1).any()  # the case mixes clipped and untouched groups
