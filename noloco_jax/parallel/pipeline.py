"""Pipeline parallelism: each replica cut into `num_stages` stages, with random routing between them.

Used when `config.num_stages` = S > 1 (training.build chooses these step functions). The model is cut
through its interface (models/base.py: `embed` on the first stage, `blocks` on each stage's slice of the
stacked layers, `head` on the last, `stage_role` for who owns what); nothing here names a parameter.
The schedule (GPipe), routing, clipping and what is communicated: docs/method.md §8 and docs/scale.md.

State layout. The mesh is (replica, stage, fsdp). The TrainState keeps the unpipelined tree and shapes
(every leaf [N, ...]); only the sharding inside a replica changes (`state_shardings`), for θ, the Adam
moments, φ and δ alike:
- the stacked layer axis ([N, num_layers, ...]) is split over `stage`: stage s holds a contiguous slice;
- the ends (embedding; final norm and head) are split over `stage` along one of their own dimensions,
  ZeRO-style, all-gathered once per step and their gradients reduce-scattered. Not kept only where they
  are used (a stage-dependent pytree cannot be one array), nor replicated (S copies of the largest leaves,
  sent S times per round). A leaf with no dimension divisible by S stays replicated over `stage` (its
  gradient is then summed over stages by shard_map's transpose).
So every parameter lives on exactly one stage: outer rounds (manual over `replica` only) exchange each
stage's shards with the same stage of the partner, weight std and checkpoints see the logical arrays (a
run can resume with another num_stages). With fsdp > 1 too, `stage` and `fsdp` split different dimensions
(or one jointly, stage-major); only fsdp = 1 is checked against a reference (tests/test_pipeline.py).

Schedule: one `lax.scan` over T = M + S − 1 slots, stage s running micro-batch t − s in slot t; every
non-last stage sends its output and the micro-batch's targets to the next stage by one ppermute per
boundary (routing.py); the backward is `jax.grad` through the scan, cotangents retracing each
micro-batch's path. A step's routes are a pure function of (seed, state.step): a resumed run replays them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax.inner import step as inner
from noloco_jax.models.base import Model
from noloco_jax.parallel import routing
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import FSDP, REPLICA, STAGE



# ---------------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------------


def _entries(role: str, stacked_shape, num_stages: int, fsdp: int) -> list:
  """The full PartitionSpec entries of a replica-stacked leaf: fsdp as sharding.py decides, plus `stage`.

  `role` is the model's `stage_role` of the leaf: "layers" (split over stages on the layer axis),
  "first" / "last" (the ends, split ZeRO-style), or "other" (step counters: replicated over stages).
  """
  base = list(sharding_lib.leaf_spec(tuple(stacked_shape), fsdp))
  entries = base + [None] * (len(stacked_shape) - len(base))
  shape = stacked_shape
  if role == "layers":
    dim = 1  # the layer axis, right after the replica axis
  elif role in ("first", "last"):
    free = [d for d in range(1, len(shape)) if entries[d] is None and shape[d] % num_stages == 0]
    joint = [d for d in range(1, len(shape)) if entries[d] == FSDP and shape[d] % (num_stages * fsdp) == 0]
    dim = (free or joint or [None])[0]
  else:
    dim = None
  if dim is not None:
    if entries[dim] is None:
      entries[dim] = STAGE
    elif shape[dim] % (num_stages * fsdp) == 0:
      entries[dim] = (STAGE, FSDP)  # stage-major: each stage's block is then split over its fsdp devices
    elif role == "layers":
      raise ValueError(f"cannot split the layer axis {shape[dim]} over {num_stages} stages × {fsdp} fsdp devices.")
  return entries


def _stage_dim(entries) -> int | None:
  for d, e in enumerate(entries):
    if e == STAGE or (isinstance(e, tuple) and STAGE in e):
      return d
  return None


def roles(tree: Any, model: Model) -> Any:
  """The model's stage role of every leaf of `tree` (the state, the params or their gradients)."""
  return jax.tree_util.tree_map_with_path(lambda path, x: model.stage_role(path), tree)


def state_shardings(abstract_state: Any, mesh: Mesh, model: Model) -> Any:
  """NamedSharding per leaf of the replica-stacked state, split over `stage` as the docstring says."""
  S, F = mesh.shape[STAGE], sharding_lib.fsdp_size(mesh)
  return jax.tree.map(lambda role, x: NamedSharding(mesh, P(*_entries(role, x.shape, S, F))),
                      roles(abstract_state, model), abstract_state)


def _manual_specs(tree: Any, num_stages: int, fsdp: int, model: Model) -> Any:
  """in/out specs for the shard_map manual over (replica, stage): fsdp is automatic, so it is left out."""
  def spec(role, x):
    entries = _entries(role, x.shape, num_stages, fsdp)
    return P(*[STAGE if d == _stage_dim(entries) else (REPLICA if d == 0 else None) for d in range(len(entries))])
  return jax.tree.map(spec, roles(tree, model), tree)


def _stage_dims(tree: Any, num_stages: int, fsdp: int, model: Model) -> Any:
  return jax.tree.map(lambda role, x: _stage_dim(_entries(role, x.shape, num_stages, fsdp)), roles(tree, model), tree)


# ---------------------------------------------------------------------------------------------------
# The schedule, for the k replicas (of one stage) a device holds, inside shard_map(replica, stage).
# ---------------------------------------------------------------------------------------------------


def _vary(x, axes=(REPLICA, STAGE)):
  """x typed as varying over `axes` (shard_map's check): scan carries and cond branches must agree."""
  have = jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _gather_ends(params_k, stage_dims, roles_):
  """Every leaf whole: the stage-split ends are all-gathered over `stage`. Layer slices stay local.

  `all_gather` returns a stage-varying value, so its transpose in the backward pass is a
  reduce-scatter (psum_scatter): each stage receives only its shard of the summed end gradients.
  """
  def gather(x, dim, role):
    if dim is None or role == "layers":
      return x
    return jax.lax.all_gather(x, STAGE, axis=dim, tiled=True)
  return jax.tree.map(gather, params_k, stage_dims, roles_, is_leaf=lambda x: x is None)


def make_forward(model: Model, num_stages: int, router: Callable) -> Callable:
  """forward(params_k, tokens_kxMxbxL1, route_MxB) -> loss_k: the GPipe forward of one device.

  route_MxB: the step's routing table (RouteSchedule.indices_traced), None with fixed routing.

  params_k: layer leaves are this stage's [k, L/S, ...] slices, the ends whole (gathered). loss_k is
  the mean over micro-batches of the loss scored on this device, non-zero on the last stage only.
  """
  S = num_stages
  # vmapped over the k local replicas; each reads only the parameters its part owns.
  embed_k = jax.vmap(model.embed)
  layers_k = jax.vmap(model.blocks)  # this stage's slice of the layers
  loss_k = jax.vmap(model.head_loss)  # the head and the loss (model.loss_chunk: never all the logits)

  def forward(params, tokens_kxMxbxL1, route_MxB):
    k, M, b, L1 = tokens_kxMxbxL1.shape
    s = jax.lax.axis_index(STAGE)
    first, last = s == 0, s == S - 1

    def slot(carry, t):
      x_in, targets_in = carry
      m = t - s  # the micro-batch this stage works on in slot t
      valid = (m >= 0) & (m < M)
      tokens = jax.lax.dynamic_index_in_dim(tokens_kxMxbxL1, jnp.clip(m, 0, M - 1), axis=1, keepdims=False)
      # lax.cond, not jnp.where: only the first stage pays for the embedding, only the last for the head.
      x = jax.lax.cond(first, lambda: _vary(embed_k(params, tokens[..., :-1])), lambda: x_in)
      targets = jnp.where(first, tokens[..., 1:], targets_in)
      y = layers_k(params, x)
      loss = jax.lax.cond(last, lambda: _vary(loss_k(params, y, targets)),
                          lambda: _vary(jnp.zeros((k,), jnp.float32)))
      loss = jnp.where(valid, loss, 0.0)
      # Hand the output to the next stage (of the same or a random replica): the slot's only collective.
      return router((y, targets), t, route_MxB), loss

    x_spec = jax.eval_shape(embed_k, params, tokens_kxMxbxL1[:, 0, :, :-1])  # [k, b, L, D] activations
    init = (_vary(jnp.zeros(x_spec.shape, x_spec.dtype)),
            _vary(jnp.zeros((k, b, L1 - 1), tokens_kxMxbxL1.dtype)))
    _, loss_Txk = jax.lax.scan(slot, init, jnp.arange(M + S - 1))
    return jnp.sum(loss_Txk, axis=0) / M

  return forward


def _group_sq_norms(grads, roles, stage_dims, num_stages: int):
  """[k, S]: squared gradient norm of the parameters each stage owns, identical on every device."""
  S = num_stages
  s = jax.lax.axis_index(STAGE)
  stages = jnp.arange(S)
  total = None
  dims = jax.tree.leaves(stage_dims, is_leaf=lambda x: x is None)  # None = replicated over stages
  for g, role, dim in zip(jax.tree.leaves(grads), jax.tree.leaves(roles), dims):
    sq = jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
    if dim is None:
      sq = sq / S  # the same full gradient on every stage: the psum below counts it S times
    owner = {"layers": s, "first": 0, "last": S - 1}.get(role, 0)
    term = _vary(sq[:, None] * (stages == owner)[None, :].astype(jnp.float32))
    total = term if total is None else total + term
  return jax.lax.psum(total, STAGE)


def _clip(grads, roles, group_sq, max_norm: float, mode: str, num_stages: int):
  """Scales each gradient leaf as optax.clip_by_global_norm would, per owner stage or over all stages."""
  s = jax.lax.axis_index(STAGE)
  if mode == "global":
    norm = jnp.sqrt(jnp.sum(group_sq, axis=1))  # [k]
    norms = {"layers": norm, "first": norm, "last": norm}
  else:
    per_stage = jnp.sqrt(group_sq)  # [k, S]
    norms = {"layers": per_stage[:, s], "first": per_stage[:, 0], "last": per_stage[:, num_stages - 1]}

  def scale(g, role):
    norm = norms.get(role, norms["first"]).reshape((-1,) + (1,) * (g.ndim - 1))
    return jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)

  return jax.tree.map(scale, grads, roles)


# ---------------------------------------------------------------------------------------------------
# The jittable step functions (what training.build uses with stages).
# ---------------------------------------------------------------------------------------------------


def num_microbatches(pipeline_cfg, batch_size: int) -> int:
  """M: config.pipeline.microbatches, or one sequence per micro-batch (0)."""
  return int(pipeline_cfg.microbatches) or int(batch_size)


def route_schedule(pipeline_cfg, *, seed: int, num_replicas: int, num_stages: int, batch_size: int,
                   mode: str | None = None) -> routing.RouteSchedule:
  """The routes between stages (config.pipeline.routing, or `mode`), a pure function of (seed, step)."""
  return routing.RouteSchedule(seed=seed, num_replicas=num_replicas, num_stages=num_stages,
                               num_microbatches=num_microbatches(pipeline_cfg, batch_size),
                               mode=mode or pipeline_cfg.routing)


def make_grads_fn(model: Model, mesh: Mesh, schedule: routing.RouteSchedule):
  """grads_fn(params_k, batch_kxBxL1, step_k) -> (loss_k, grads) inside shard_map(replica, stage).

  loss_k is summed over stages (the last stage's loss), grads are this device's shards. Exposed for
  the tests, which compare it with the unpipelined gradients.
  """
  S, F = mesh.shape[STAGE], sharding_lib.fsdp_size(mesh)
  forward = make_forward(model, S, routing.make_slot_router(schedule, mesh.shape[REPLICA]))
  M = schedule.num_microbatches

  def grads_fn(params, batch_kxBxL1, step_k, global_shapes):
    stage_dims, roles_ = _stage_dims(global_shapes, S, F, model), roles(global_shapes, model)
    k, B, L1 = batch_kxBxL1.shape
    tokens = batch_kxBxL1.reshape(k, M, B // M, L1)
    # The routes of this step: every replica has taken the same number of steps, so every device
    # draws the same table (and takes the same switch branches) without communicating.
    route_MxB = schedule.indices_traced(step_k[0])

    def loss_fn(p):
      loss_k = forward(_gather_ends(p, stage_dims, roles_), tokens, route_MxB)
      return jnp.sum(loss_k), loss_k

    (_, loss_k), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # Only the last stage scored anything: the sum over stages is the replica's loss (N floats).
    return jax.lax.psum(loss_k, STAGE), grads

  return grads_fn


def make_inner_step(pipeline_cfg, model: Model, mesh: Mesh, optimizer: optax.GradientTransformation,
                    schedule: routing.RouteSchedule, *, grad_clip: float,
                    reduce_grads: Callable | None = None) -> Callable:
  """step(state without outer, batch [N, B, L+1]) -> (state, {"loss": [N], "grad_norm": [N]}).

  `optimizer` is inner.make_optimizer(..., clip=False): this step clips the gradients itself to
  `grad_clip` (config.inner.grad_clip), per stage or globally (config.pipeline.clip), before the
  optimizer's update. `schedule`: the routes between stages (`route_schedule`).
  """
  S, F = mesh.shape[STAGE], sharding_lib.fsdp_size(mesh)
  grads_fn = make_grads_fn(model, mesh, schedule)
  max_norm, mode = float(grad_clip), pipeline_cfg.clip

  def local(state, batch_kxBxL1, global_shapes):
    roles_ = roles(global_shapes, model)
    stage_dims = _stage_dims(global_shapes, S, F, model)
    loss_k, grads = grads_fn(state.params, batch_kxBxL1, state.step, global_shapes)
    group_sq = _group_sq_norms(grads, roles_, stage_dims, S)
    grad_norm_k = jnp.sqrt(jnp.sum(group_sq, axis=1))
    if reduce_grads is not None:  # ddp: per stage, each device averages its own shards over `replica`
      grads = reduce_grads(grads)
      group_sq = _group_sq_norms(grads, roles_, stage_dims, S)
    if max_norm > 0:
      grads = _clip(grads, roles_, group_sq, max_norm, mode, S)
    # Adam is elementwise: each device updates its own shards (layer slice, 1/S of the ends).
    state = jax.vmap(inner.apply_grads, in_axes=(0, 0, None))(state, grads, optimizer)
    return state, {"loss": loss_k, "grad_norm": grad_norm_k}

  def step(state, batch):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    specs = _manual_specs(state, S, F, model)
    fn = jax.shard_map(functools.partial(local, global_shapes=shapes), mesh=mesh,
                       in_specs=(specs, P(REPLICA)), out_specs=(specs, P(REPLICA)),
                       axis_names={REPLICA, STAGE})
    return fn(state, batch)

  return step


def make_eval_step(model: Model, mesh: Mesh, schedule: routing.RouteSchedule, batch_size: int) -> Callable:
  """eval(params, batch [B, L+1]) -> loss [N]: every replica scores the batch with its own weights.

  `schedule`: fixed routing (each replica's own stages in order: route_schedule(..., mode="fixed")), whatever
  the training routing; `batch_size`: the training batch, whose micro-batch size evaluation uses too.
  """
  S, F = mesh.shape[STAGE], sharding_lib.fsdp_size(mesh)
  forward = make_forward(model, S, routing.make_slot_router(schedule, mesh.shape[REPLICA]))
  micro = batch_size // schedule.num_microbatches  # sequences per micro-batch, as in training

  def local(params, batch_BxL1, global_shapes):
    k = jax.tree.leaves(params)[0].shape[0]
    B, L1 = batch_BxL1.shape
    b = micro if B % micro == 0 else 1
    tokens = jnp.broadcast_to(batch_BxL1.reshape(1, B // b, b, L1), (k, B // b, b, L1))
    ends = _gather_ends(params, _stage_dims(global_shapes, S, F, model), roles(global_shapes, model))
    loss_k = forward(ends, tokens, None)
    return jax.lax.psum(loss_k, STAGE)

  def evaluate(params, batch_BxL1):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    fn = jax.shard_map(functools.partial(local, global_shapes=shapes), mesh=mesh,
                       in_specs=(_manual_specs(params, S, F, model), P()), out_specs=P(REPLICA),
                       axis_names={REPLICA, STAGE})
    return fn(params, batch_BxL1)

  return evaluate


def bubble_fraction(num_stages: int, num_microbatches_: int) -> float:
  """GPipe's idle fraction of each stage: (S − 1) / (M + S − 1)."""
  return (num_stages - 1) / (num_microbatches_ + num_stages - 1)
