"""NoLoCo's outer update when a group's members are at different progress (the asynchronous schedule).

In the lock-step schedule every member of a group has taken the same number of inner steps when
they exchange. In the asynchronous one (noloco_jax/asynchronous/) a process is paired with whoever
is ready, and a partner may be behind: its message c = β·θ + (γ − β)·φ then carries less training.
The rule here weighs each member's message by how far behind it is:

    lag_k = (max_j s_j − s_k) / H          rounds behind the group's most advanced member
                                           (s = the member's progress: the inner steps behind its
                                           weights; tokens = s × batch × sequence length)
    q_k   = exp(−λ · lag_k)                λ = the staleness decay per round (0: no discount)
    m     = Σ_k q_k · c_k / Σ_k q_k         the weighted group mean of the messages (exchange.mean_of)
    δ ← α·δ + m − γ·φ_i ;  φ ← φ + δ ;  θ ← φ        (the method's own merge, unchanged)

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

Progress (`merged_progress`): the inner steps behind a member's weights, counted the way the weights are
mixed: every inner step adds one, and after an exchange every member takes the group's weighted mean
progress Σ_k q_k s_k / Σ_k q_k (not the raw step count, which drifts apart without bound under a
persistent straggler: docs/async.md §4).

With equal progress every q_k = 1 and m = (Σ_k c_k) / n, computed in the order and precision of the
lock-step group mean (exchange.mean_of: float32, own message first, one division by the constant n): the
update is then the synchronous one bit for bit (tests/test_async_driver.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def staleness_weights(progress: Sequence[int], *, inner_steps: int, decay: float) -> np.ndarray:
  """[n] float32 q_k = exp(−decay · lag_k) (unnormalised; 1 for the most advanced members)."""
  if inner_steps < 1:
    raise ValueError(f"outer.inner_steps={inner_steps} is not valid: an integer ≥ 1.")
  if not decay >= 0:
    raise ValueError(f"outer.asynchronous.staleness_decay={decay} is not valid: a number ≥ 0 (0 turns the discount off).")
  steps = np.asarray(progress, np.float64)
  if steps.ndim != 1 or steps.size < 1 or (steps < 0).any():
    raise ValueError(f"progress={list(progress)} is not valid: one count of inner steps ≥ 0 per group member.")
  lag = (steps.max() - steps) / inner_steps
  return np.exp(-decay * lag).astype(np.float32)


def equal(weights) -> bool:
  """Whether every weight is the same (then the group mean is the synchronous one: exchange.mean_of(..., None))."""
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
