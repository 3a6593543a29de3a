"""Mean-square stability of NoLoCo's outer update under random group averaging (docs/stability.md).

Pure NumPy. Per coordinate, with x_i = φ_i − mean φ and y_i = δ_i − mean δ (deviations from the replica
mean) and A the round's averaging matrix (A_ij = 1/n when i and j share a group), the implemented rule
(outer/methods/noloco.py: δ ← α·δ + β·mean_G(θ − φ) + γ·(mean_G φ − φ_i), φ ← φ + δ) gives

    y' = γ(A − I)x + αy + βA·u,      x' = x + y',

where u = θ − φ is the round's local progress. Model of the inner steps: u_i = −λ·x_i + ξ_i, with ξ_i
independent noise of variance σ² per coordinate (independent across replicas and rounds) and λ ∈ [0, 1]
the contraction the inner steps apply to a deviation (λ = 1 − (1 − ηh)^H for curvature h and learning
rate η; λ = 0, the default, is a flat direction where only noise acts). So, with c = γ − βλ,

    (x', y') = (B0 ⊗ I + B1 ⊗ A)(x, y) + β·(1, 1) ⊗ Aξ,   B0 = [[1−γ, α], [−γ, α]],   B1 = c·[[1, 0], [1, 0]].

For uniformly random groups of n out of N, E[A] = J + a·Q and A² = A, where J = 11ᵀ/N, Q = I − J and

    a = (N − n) / (n (N − 1))        (the expected shrink of the variance in one gossip round),

and the law of A is invariant under relabelling the replicas, so the second moments stay of the form
E[(x, y)(x, y)ᵀ] = C ⊗ Q with C a symmetric 2×2 matrix, and one round maps

    C ← B0 C B0ᵀ + a·(B0 C B1ᵀ + B1 C B0ᵀ + B1 C B1ᵀ) + a·β²σ²·[[1, 1], [1, 1]].

The spread is mean-square stable iff the spectral radius ρ of the linear part is < 1 (a positive map:
its spectral radius is reached on the exchangeable second moments, so nothing is lost by the reduction).
The cross-replica variance of φ is C_xx·(N − 1)/N; it changes by the factor ρ per round in the long run
(the weight std by √ρ). Without λ, β only scales the noise: stability depends on α, γ, n and N.
"""

from __future__ import annotations

import math

import numpy as np


def averaging_shrink(group_size: int, num_replicas: int) -> float:
  """a = (N − n)/(n(N − 1)): E[AQA] = a·Q for uniformly random groups of n out of N."""
  n, N = group_size, num_replicas
  return (N - n) / (n * (N - 1))


def _blocks(alpha: float, beta: float, gamma: float, inner_contraction: float) -> tuple[np.ndarray, np.ndarray]:
  c = gamma - beta * inner_contraction
  return np.array([[1 - gamma, alpha], [-gamma, alpha]]), np.array([[c, 0.0], [c, 0.0]])


def second_moment_map(alpha: float, gamma: float, group_size: int, num_replicas: int, *, beta: float = 0.0,
                      inner_contraction: float = 0.0) -> np.ndarray:
  """[4, 4]: vec(C) ↦ vec(C') of one round, without the noise (row-major vec of the 2×2 C)."""
  B0, B1 = _blocks(alpha, beta, gamma, inner_contraction)
  a = averaging_shrink(group_size, num_replicas)
  return np.kron(B0, B0) + a * (np.kron(B0, B1) + np.kron(B1, B0) + np.kron(B1, B1))


def spectral_radius(alpha: float, gamma: float, group_size: int, num_replicas: int, *, beta: float = 0.0,
                    inner_contraction: float = 0.0) -> float:
  """ρ: the long-run factor per round of the cross-replica variance. Stable iff ρ < 1."""
  L = second_moment_map(alpha, gamma, group_size, num_replicas, beta=beta, inner_contraction=inner_contraction)
  return float(np.max(np.abs(np.linalg.eigvals(L))))


def spread_growth_per_round(alpha: float, gamma: float, group_size: int, num_replicas: int, **kwargs) -> float:
  """√ρ: the long-run factor per round of the (root-mean-square) weight std across replicas."""
  return math.sqrt(spectral_radius(alpha, gamma, group_size, num_replicas, **kwargs))


def stationary_second_moments(*, alpha: float, beta: float, gamma: float, group_size: int, num_replicas: int,
                              noise_var: float = 1.0, inner_contraction: float = 0.0) -> np.ndarray | None:
  """The fixed point C* of the noise-driven recursion (None when unstable): the spread it settles at."""
  L = second_moment_map(alpha, gamma, group_size, num_replicas, beta=beta, inner_contraction=inner_contraction)
  if np.max(np.abs(np.linalg.eigvals(L))) >= 1:
    return None
  noise = averaging_shrink(group_size, num_replicas) * beta ** 2 * noise_var * np.ones(4)
  return np.linalg.solve(np.eye(4) - L, noise).reshape(2, 2)


# ---- Compressed messages that reach part of the model (outer.compression='coset', outer/coset.py) ----
#
# A round whose message reaches each value with probability p (a fragment drawn at random each round, or
# one random direction per group of g = 1/p values: the same second moments) is, per value, the group
# map above with probability p and otherwise a local step (A = I: y' = αy − βλx + βξ, x' = x + y').
# Where it arrives, the decoded message carries an independent error of variance r·E[D²], D = c_j − c_i
# the pair's difference (a coset code's dither: r = κ²/12, κ = ε / rms D); it enters the receiver's
# mean with weight 1/n = 1/2, so C gains (r/4)·E[D²]·[[1, 1], [1, 1]] with E[D²] = 2(γ − βλ)²·C_xx + 2β²σ².
# The map stays linear in C: ρ < 1 is again the condition. What it leaves out: wrap errors of the coset
# code (|D| beyond its range), and the step ε tracking E[D²] only through the codec's running estimate.


def _local_block(alpha: float, beta: float, gamma: float, inner_contraction: float) -> np.ndarray:
  B0, B1 = _blocks(alpha, beta, gamma, inner_contraction)
  return B0 + B1  # the group map with A = I: nothing received, x' = x + y', y' = αy − βλx


def coded_second_moment_map(alpha: float, gamma: float, group_size: int, num_replicas: int, *, coverage: float,
                            relative_noise: float = 0.0, beta: float = 0.0, inner_contraction: float = 0.0) -> np.ndarray:
  """[4, 4]: vec(C) ↦ vec(C') of one round of a message reaching a fraction `coverage` of the values (at
  random), decoded with an error of variance relative_noise·E[D²]; without the inner-step noise. group_size 2."""
  if group_size != 2:
    raise ValueError("the coded map is derived for pairs (group_size 2)")
  B = _local_block(alpha, beta, gamma, inner_contraction)
  c = gamma - beta * inner_contraction
  noise = np.zeros((4, 4))
  noise[:, 0] = relative_noise / 4 * 2 * c * c  # C_xx -> every entry of C
  group = second_moment_map(alpha, gamma, group_size, num_replicas, beta=beta, inner_contraction=inner_contraction)
  return coverage * (group + noise) + (1 - coverage) * np.kron(B, B)


def paper_interval(alpha: float, group_size: int) -> tuple[float, float]:
  """The NoLoCo paper's bound (noisy quadratic model): √(n/(2(n−1)))·α < γ < √(n(2+α²)/(2(n−1)))."""
  n = group_size
  return math.sqrt(n / (2 * (n - 1))) * alpha, math.sqrt(n * (2 + alpha ** 2) / (2 * (n - 1)))


def instability(alpha: float, gamma: float, group_size: int, num_replicas: int) -> str | None:
  """None if the spread is mean-square stable (λ = 0), else one line saying why, for config validation."""
  rho = spectral_radius(alpha, gamma, group_size, num_replicas)
  if rho < 1:
    return None
  low, high = paper_interval(alpha, group_size)
  inside = "inside" if low < gamma < high else "outside"
  return (f"with outer.rule.outer_momentum={alpha:g} (α), outer.rule.consensus_weight={gamma:g} (γ), "
          f"group_size={group_size}, "
          f"num_replicas={num_replicas} the cross-replica weight spread is unstable: it grows by "
          f"{100 * (math.sqrt(rho) - 1):.1f}% per round (spectral radius {rho:.3f} ≥ 1; docs/stability.md; "
          f"the paper's interval {low:.3f} < γ < {high:.3f}, which γ is {inside}, does not apply here)")
