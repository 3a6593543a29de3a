"""The consensus model: the one set of weights a user ships after a run that ends with N different replicas.

A NoLoCo run never all-reduces, so its replicas end apart (replicas/weight_std > 0). The consensus
model is their plain average, of the slow weights φ (what the outer steps agree on; the default) or of
the fast weights θ (`source="theta"`). Methods that keep no slow weights (ddp, none) average θ. Both
are pure functions of replica-stacked trees (every leaf [N, ...]); `consensus_loss` evaluates the result
with a model's loss on validation batches. They run on host arrays (the tools after a run) or inside
jit (the evaluation plug-in, training/consensus_eval.py), unchanged.

The mean is taken in float32 and cast to θ's dtype (the model's parameter dtype), so a bfloat16 run's
consensus is the float32 average rounded once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

SOURCES = ("slow", "theta")
SLOW_KEY = "slow"  # the slow weights φ in TrainState.outer (the outer methods keep it there), for readers of a checkpoint


def replica_mean(tree_NxP) -> Any:
  """Mean over the leading replica axis of every leaf, computed in float32, in each leaf's dtype."""
  return jax.tree.map(lambda x: jnp.mean(jnp.asarray(x, jnp.float32), axis=0).astype(x.dtype), tree_NxP)


def consensus_params(params_NxP, slow_NxP=None, source: str = "slow") -> Any:
  """The consensus weights: mean over replicas of φ (`source="slow"`; θ when there is no φ) or of θ."""
  if source not in SOURCES:
    raise ValueError(f"consensus source={source!r}; valid: {', '.join(SOURCES)}.")
  if source == "theta" or slow_NxP is None:
    return replica_mean(params_NxP)
  # φ may be stored in another dtype (outer.state_dtype): the consensus takes θ's, the model's dtype.
  return jax.tree.map(lambda s, p: jnp.mean(jnp.asarray(s, jnp.float32), axis=0).astype(p.dtype), slow_NxP, params_NxP)


def consensus_loss(loss_fn: Callable, params, batches_ExBxL1) -> jax.Array:
  """Mean next-token loss of one set of weights over E validation batches of [B, L+1] tokens.

  `loss_fn(params, tokens_BxL, targets_BxL)` is the model interface's loss (models/base.py:
  `Model.loss`), a mean over the batch's tokens; every batch has the same shape, so the mean of
  the batch means is the mean over all tokens.
  """
  def one(batch_BxL1):
    return loss_fn(params, batch_BxL1[:, :-1], batch_BxL1[:, 1:])

  return jnp.mean(jax.lax.map(one, jnp.asarray(batches_ExBxL1)))
