"""The inner step: plain local training of one replica, no collectives.

`compute_grads` and `apply_grads` are written for ONE replica. `make_inner_step` maps them over the
k replicas a device holds (vmapped or in a loop: inner/replicas.py) and leaves one hook between the
two, `reduce_grads`, through which the data-parallel baseline averages gradients across replicas;
every other method passes None and the step stays free of communication.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from noloco_jax.inner import replicas
from noloco_jax.inner.state import TrainState


def learning_rate_schedule(inner_cfg: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at `num_steps`."""
  warmup = min(int(inner_cfg.warmup_steps), num_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=inner_cfg.lr, warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1), end_value=inner_cfg.lr * inner_cfg.min_lr_ratio)


def make_optimizer(inner_cfg: ml_collections.ConfigDict, num_steps: int, *,
                   clip: bool = True) -> optax.GradientTransformation:
  """Adam or AdamW on the schedule above, after clipping the gradient's global norm to inner.grad_clip.

  `clip=False` (the pipeline, which clips per stage or across stages itself) puts an `identity` in
  the clipping slot: its state is the same EmptyState, so the optimizer state keeps one tree and
  checkpoints stay interchangeable across num_stages.
  """
  schedule = learning_rate_schedule(inner_cfg, num_steps)
  if inner_cfg.optimizer == "adam":
    opt = optax.adam(schedule, b1=inner_cfg.b1, b2=inner_cfg.b2, eps=inner_cfg.eps)
  else:  # "adamw" (validated by noloco_jax/config/inner.py)
    opt = optax.adamw(schedule, b1=inner_cfg.b1, b2=inner_cfg.b2, eps=inner_cfg.eps,
                      weight_decay=inner_cfg.weight_decay)
  if inner_cfg.grad_clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(inner_cfg.grad_clip) if clip else optax.identity(), opt)
  return opt


def loss_fn(params, batch_BxL1, loss_of):
  """Next-token loss of one replica on a packed batch of L+1 tokens (inputs and shifted targets).

  `loss_of(params, tokens_BxL, targets_BxL) -> mean loss` is a model's `loss` (models/base.py): the
  model computes its own loss, so that with model.loss_chunk it never materialises the logits.
  """
  return loss_of(params, batch_BxL1[:, :-1], batch_BxL1[:, 1:])


def compute_grads(params, batch_BxL1, loss_of):
  """One replica: (loss, grads)."""
  return jax.value_and_grad(loss_fn)(params, batch_BxL1, loss_of)


def microbatch_slices(batch_BxL1, microbatches: int):
  """[M, B/M, L+1]: micro-batch m holds rows m, M+m, 2M+m, … (strided, not contiguous).

  Strided so that a batch split over `fsdp` on its rows (sharding.batch_sharding) stays split the
  same way inside every micro-batch: the reshape [B] -> [B/M, M] keeps each device's contiguous block
  of rows on the first axis, and the scan then walks the unsplit M axis with no communication.
  """
  return jnp.swapaxes(batch_BxL1.reshape(-1, microbatches, batch_BxL1.shape[-1]), 0, 1)


def accumulate_grads(params, batch_BxL1, loss_of, microbatches: int = 1):
  """One replica: (loss, grads) of the whole batch, computed `microbatches` slices at a time.

  The slices are equal, so the mean of their mean losses (and gradients) is the full batch's: the
  same update as one pass, up to float rounding; activation memory is that of one slice. The sums
  run in float32 whatever the parameter dtype.
  """
  if microbatches <= 1:
    return compute_grads(params, batch_BxL1, loss_of)

  def add_slice(total, batch_bxL1):
    loss, grads = compute_grads(params, batch_bxL1, loss_of)
    return jax.tree.map(lambda t, x: t + x.astype(jnp.float32), total, (loss, grads)), None

  # zeros_like (not zeros): the carry must vary over the mesh axes exactly as what is added to it
  # (inside shard_map, per replica), which zeros_like inherits from its argument.
  zeros = jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), (batch_BxL1[0, 0], params))
  (loss, grads), _ = jax.lax.scan(add_slice, zeros, microbatch_slices(batch_BxL1, microbatches))
  grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, params)
  return loss / microbatches, grads


def apply_grads(state: TrainState, grads, optimizer: optax.GradientTransformation) -> TrainState:
  """One replica: one optimizer update of the fast weights."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       opt_state=opt_state)


def make_inner_step(loss_of, optimizer: optax.GradientTransformation,
                    reduce_grads: Callable | None = None, microbatches: int = 1, replica_map: str = "vmap"):
  """Returns step(states_k, batches_k) -> (states_k, metrics) over the k replicas of one device.

  `microbatches` > 1 accumulates each replica's gradient over that many slices of its batch.
  `replica_map` is a resolved mode of inner/replicas.py (`vmap` or `sequential`); it maps the gradient
  (the model's forward and backward), the one part whose speed depends on it. The update is vmapped in
  both modes: it is elementwise work plus one norm per replica, which batches at full speed, and in the
  loop it would slice each replica's parameters and both Adam moments out of the stacked state and
  write them back (three model copies in and out per replica; 9% of the loop's step on the tiny model,
  experiments/RESULTS.md). `reduce_grads` sits between the two: the data-parallel baseline averages
  gradients across replicas there; every other method passes None and the step stays free of
  communication.
  """
  grads_k = replicas.over_replicas(lambda params, batch: accumulate_grads(params, batch, loss_of, microbatches),
                                   replica_map)
  apply_k = jax.vmap(lambda state, grads: apply_grads(state, grads, optimizer))

  def step(states: TrainState, batches_kxBxL1):
    loss_k, grads = grads_k(states.params, batches_kxBxL1)
    grad_norm_k = jax.vmap(optax.tree.norm)(grads)
    if reduce_grads is not None:
      grads = reduce_grads(grads)
    states = apply_k(states, grads)
    return states, {"loss": loss_k, "grad_norm": grad_norm_k}

  return step


def make_eval_step(loss_of, microbatches: int = 1, replica_map: str = "vmap"):
  """Returns eval(params_k, batch_BxL1) -> loss_k: every local replica evaluates its own weights.

  With `microbatches` > 1 the batch is scored that many equal slices at a time (same mean loss).
  `replica_map`: as for make_inner_step.
  """

  def one_replica(params, batch_BxL1):
    if microbatches <= 1:
      return loss_fn(params, batch_BxL1, loss_of)
    losses = jax.lax.map(lambda b: loss_fn(params, b, loss_of), microbatch_slices(batch_BxL1, microbatches))
    return jnp.mean(losses.astype(jnp.float32))

  return replicas.over_replicas(one_replica, replica_map, in_axes=(0, None))
