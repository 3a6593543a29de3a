"""NoLoCo's outer update when a group's members are at different progress (the asynchronous schedule).

In the lock-step schedule every member of a group has taken the same number of inner steps when
they exchange. In the asynchronous one (noloco_jax/asynchronous/) a process is paired with whoever
is ready, and a slower partner may have taken fewer steps: its message c = β·θ + (γ − β)·φ carries
older information. The rule here weighs each member's message by how far behind it is:

    lag_k = (max_j s_j − s_k) / H          rounds behind the group's most advanced member
                                           (s = inner steps taken, the progress each member reports;
                                           tokens = s × batch × sequence length, the same for all)
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

With equal progress every q_k = 1 and m = (Σ_k c_k) / n, computed in the order and precision of
exchange.group_mean (float32, own message first, one division): the update is then the synchronous
one bit for bit (tests/test_async_rules.py).
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


def weighted_mean(messages: Sequence, weights: np.ndarray):
  """Σ_k w_k · c_k / Σ_k w_k over pytrees (own message first), in float32, in that order."""
  if len(messages) != len(weights):
    raise ValueError(f"{len(messages)} messages but {len(weights)} weights.")
  weights = [np.float32(w) for w in np.asarray(weights, np.float32)]
  total = jax.tree.map(lambda c: weights[0] * c.astype(jnp.float32), messages[0])
  for w, message in zip(weights[1:], messages[1:]):
    total = jax.tree.map(lambda t, c, w=w: t + w * c.astype(jnp.float32), total, message)
  norm = np.float32(sum(weights, np.float32(0)))
  return jax.tree.map(lambda t: t / norm, total)


def async_noloco_update(phi, delta, messages: Sequence, progress: Sequence[int], *, alpha: float, gamma: float,
                        inner_steps: int, decay: float):
  """(θ, φ, δ) after an exchange: `messages` and `progress` list this member first, then its partners."""
  weights = staleness_weights(progress, inner_steps=inner_steps, decay=decay)
  return rules.noloco_update(phi, delta, weighted_mean(messages, weights), alpha=alpha, gamma=gamma)
