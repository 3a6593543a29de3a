"""NoLoCo's outer update when a group's members are at different progress (the asynchronous schedule).

In the lock-step schedule every member of a group has taken the same number of inner steps when
they exchange. In the asynchronous one (noloco_jax/asynchronous/) a process is paired with whoever
is ready, and a partner may be behind: its message c = β·θ + (γ − β)·φ then carries less training.
The rule here weighs each member's message by how far behind it is:

    lag_k = (max_j s_j − s_k) / H          rounds behind the group's most advanced member
                                           (s = the member's progress: the inner steps behind its
                                           weights; tokens = s × batch × sequence length)
    q_k   = exp(−λ · lag_k)                λ = the staleness decay per round (0: no discount)
    m     = Σ_k q_k · c_k / Σ_k q_k         the weighted group mean of the messages
    δ ← α·δ + m − γ·φ_i ;  φ ← φ + δ ;  θ ← φ        (rules.noloco_update, unchanged)

Why this form. It is NoLoCo's update with mean_G(c) replaced by a weighted mean, so every property
of the synchronous rule that only needs the weights to sum to one carries over: the consensus term
still pulls φ_i towards a convex combination of the group's slow weights, and every member computes
the same weights (they depend on the group's progress values only), so all members of a group move
towards the same point, as in the lock-step schedule. The weights are in the spirit of Decoupled
DiLoCo's token-weighted merge (a contribution counts by the work behind it), here relative to the
group's front-runner, so that only *lag* discounts a message, not a long run's absolute tokens.
Corrections that reshape the partner's message itself (HeLoCo's momentum-aligned correction,
AsyncMesh's EMA estimate of the staleness drift) are not used: both target a central outer
optimiser applying one stale pseudo-gradient, while here both sides of the exchange apply an update
at once from messages produced at the same wall-clock time.

Progress. A member's progress s is the number of inner steps behind its weights, counted the way
the weights are mixed: every inner step adds one, and after an exchange every member of the group
takes the group's weighted mean progress Σ_k q_k s_k / Σ_k q_k (`merged_progress`), the progress of
the point they all move towards. Why not the raw step count: with a persistent straggler the raw
counts drift apart without bound (after t seconds a 2× straggler has half the steps), so its every
message would soon weigh nothing, although after each exchange its weights hold its partners'
training; the merged count keeps its lag at what it missed since its last exchange (about a round),
while a process that has been cut off (skipped exchanges, a long stall) falls behind and is
discounted. With equal speeds all counts stay equal and the rule is the synchronous one.

With equal progress every q_k = 1 and m = (Σ_k c_k) / n, computed in the order and precision of
exchange.group_mean (float32, own message first, one division by the constant n): the update is then
the synchronous one bit for bit (tests/test_async_rules.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.outer import rules


def staleness_weights(progress: Sequence[int], *, inner_steps: int, decay: float) -> np.ndarray:
  """[n] float32 q_k = exp(−decay · lag_k) (unnormalised; 1 for the most advanced members)."""
  if inner_steps < 1:
    raise ValueError(f"outer.inner_steps={inner_steps} is not valid: an integer ≥ 1.")
  if not decay >= 0:
    raise ValueError(f"outer.staleness_decay={decay} is not valid: a number ≥ 0 (0 turns the discount off).")
  steps = np.asarray(progress, np.float64)
  if steps.ndim != 1 or steps.size < 1 or (steps < 0).any():
    raise ValueError(f"progress={list(progress)} is not valid: one count of inner steps ≥ 0 per group member.")
  lag = (steps.max() - steps) / inner_steps
  return np.exp(-decay * lag).astype(np.float32)


def weighted_mean(messages: Sequence, weights=None):
  """Σ_k w_k · c_k / Σ_k w_k over pytrees (own message first), in float32, summed in that order.

  `weights` None means all equal: then it is exchange.group_mean's arithmetic exactly (the sum, then
  one division by the count n, a constant; XLA:CPU turns that into a multiplication by 1/n, so a
  division by a computed Σ w = n would differ in the last bit). Otherwise `weights` may be a NumPy
  array or a traced one (the round driver jits this with the weights as an argument, so one program
  serves every value of them).
  """
  if weights is None:
    total = jax.tree.map(lambda c: c.astype(jnp.float32), messages[0])
    for message in messages[1:]:
      total = jax.tree.map(lambda t, c: t + c.astype(jnp.float32), total, message)
    return jax.tree.map(lambda t: t / len(messages), total)
  if len(messages) != len(weights):
    raise ValueError(f"{len(messages)} messages but {len(weights)} weights.")
  w = jnp.asarray(weights, jnp.float32)
  total = jax.tree.map(lambda c: w[0] * c.astype(jnp.float32), messages[0])
  norm = w[0]
  for k, message in enumerate(messages[1:], start=1):
    total = jax.tree.map(lambda t, c, k=k: t + w[k] * c.astype(jnp.float32), total, message)
    norm = norm + w[k]
  return jax.tree.map(lambda t: t / norm, total)


def equal(weights) -> bool:
  """Whether every weight is the same (then `weighted_mean(messages, None)` is the synchronous mean)."""
  w = np.asarray(weights)
  return bool((w == w[0]).all())


def merged_progress(progress: Sequence[float], weights) -> float:
  """The progress of the point a group moves towards: Σ_k q_k · s_k / Σ_k q_k (float64).

  After an exchange every member takes it as its own progress (module docstring: progress counts the
  inner steps behind a member's weights, and the weights now mix the group's in these proportions).
  With equal progress it is that progress exactly.
  """
  q = np.asarray(weights, np.float64)
  return float(np.dot(q, np.asarray(progress, np.float64)) / q.sum())


def async_noloco_update(phi, delta, messages: Sequence, progress: Sequence[int], *, alpha: float, gamma: float,
                        inner_steps: int, decay: float):
  """(θ, φ, δ) after an exchange: `messages` and `progress` list this member first, then its partners."""
  weights = staleness_weights(progress, inner_steps=inner_steps, decay=decay)
  mean = weighted_mean(messages, None if equal(weights) else weights)
  return rules.noloco_update(phi, delta, mean, alpha=alpha, gamma=gamma)
