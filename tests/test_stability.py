"""outer/stability.py against a Monte-Carlo of the project's own round arithmetic (outer/methods/noloco.py) with the
project's own random groupings (outer/pairing.py), on stacked replicas, and the issue's two examples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.outer import exchange, pairing, stability
from noloco_jax.outer.methods import noloco

N, TRIALS, COORDS = 8, 192, 32


# The exact second-moment recursions (module doc of outer/stability.py), the references the Monte-Carlo
# runs here and in test_coset.py are checked against.
def second_moments(rounds: int, C0: np.ndarray, *, alpha: float, beta: float, gamma: float, group_size: int,
                   num_replicas: int, noise_var: float = 0.0, inner_contraction: float = 0.0) -> np.ndarray:
  """[rounds + 1, 2, 2]: the exact C after 0 … rounds rounds, from C0 (E[(x, y)(x, y)ᵀ] = C ⊗ Q)."""
  B0, B1 = stability._blocks(alpha, beta, gamma, inner_contraction)  # pylint: disable=protected-access
  a = stability.averaging_shrink(group_size, num_replicas)
  noise = a * beta ** 2 * noise_var * np.ones((2, 2))
  out = [np.asarray(C0, np.float64)]
  for _ in range(rounds):
    C = out[-1]
    out.append(B0 @ C @ B0.T + a * (B0 @ C @ B1.T + B1 @ C @ B0.T + B1 @ C @ B1.T) + noise)
  return np.stack(out)


def coded_second_moments(rounds: int, C0: np.ndarray, *, alpha: float, beta: float, gamma: float, num_replicas: int,
                         coverage: float, relative_noise: float = 0.0, noise_var: float = 0.0,
                         inner_contraction: float = 0.0) -> np.ndarray:
  """[rounds + 1, 2, 2]: C after 0 … rounds coded rounds (pairs), from C0, with inner-step noise σ² = noise_var."""
  L = stability.coded_second_moment_map(alpha, gamma, 2, num_replicas, coverage=coverage,
                                        relative_noise=relative_noise, beta=beta, inner_contraction=inner_contraction)
  a = stability.averaging_shrink(2, num_replicas)
  drive = beta ** 2 * noise_var * (coverage * (a + relative_noise / 2) + (1 - coverage)) * np.ones(4)
  out = [np.asarray(C0, np.float64)]
  for _ in range(rounds):
    out.append((L @ out[-1].reshape(4) + drive).reshape(2, 2))
  return np.stack(out)


def _monte_carlo(*, alpha, beta, gamma, group_size, rounds, noise, init, seed):
  """[rounds + 1, 3, TRIALS]: per trial, the sample (C_xx, C_xy, C_yy) of the deviations after each round.

  Each trial is an independent run of `rounds` NoLoCo rounds with its own sequence of fresh groupings;
  COORDS coordinates per replica share the groupings. θ − φ is independent N(0, noise) per coordinate.
  """
  rng = np.random.default_rng(seed)
  tables = np.stack([  # [TRIALS, rounds, n−1, N]: each trial's groupings as gather tables
      np.stack([pairing.source_table(pairing.PairingSchedule(
          seed=seed * 1000 + trial, num_replicas=N, group_size=group_size).groups(t)) for t in range(rounds)])
      for trial in range(TRIALS)])
  u = (np.sqrt(noise) * rng.normal(size=(TRIALS, rounds, N, COORDS))).astype(np.float32)
  phi0 = (init * rng.normal(size=(TRIALS, N, COORDS))).astype(np.float32)
  delta0 = (init * rng.normal(size=(TRIALS, N, COORDS))).astype(np.float32)

  def one_round(carry, inputs):
    phi, delta = carry
    table, u_NxC = inputs
    theta = phi + u_NxC
    c = exchange.message(theta, phi, beta=beta, gamma=gamma)
    mean_c = (c + sum(c[table[s]] for s in range(group_size - 1))) / group_size  # the group mean
    phi, delta = noloco.update(phi, delta, mean_c, alpha=alpha, gamma=gamma)
    return (phi, delta), (phi, delta)

  def trial(phi, delta, tables_R, u_R):
    _, (phis, deltas) = jax.lax.scan(one_round, (phi, delta), (tables_R, u_R))
    return jnp.concatenate([phi[None], phis]), jnp.concatenate([delta[None], deltas])

  phis, deltas = jax.jit(jax.vmap(trial))(phi0, delta0, tables, u)
  x = np.asarray(phis, np.float64) - np.asarray(phis, np.float64).mean(axis=2, keepdims=True)
  y = np.asarray(deltas, np.float64) - np.asarray(deltas, np.float64).mean(axis=2, keepdims=True)
  # E[x xᵀ] = C_xx·Q and tr Q = N − 1: the unbiased per-trial estimate of C_xx is Σ_i x_i² / (N − 1).
  scale = 1.0 / ((N - 1) * COORDS)
  est = [(x * x).sum(axis=(2, 3)) * scale, (x * y).sum(axis=(2, 3)) * scale, (y * y).sum(axis=(2, 3)) * scale]
  return np.stack(est, axis=0).transpose(2, 0, 1)  # [rounds + 1, 3, TRIALS]


def _check_against_exact(mc, exact, rounds_to_check):
  for t in rounds_to_check:
    for j, (a, b) in enumerate([(0, 0), (0, 1), (1, 1)]):
      mean = mc[t, j].mean()
      se = mc[t, j].std(ddof=1) / np.sqrt(TRIALS)
      # Beside the sampling error, float32 round-off of a few ulps of the moments' own scale: an entry
      # that is exactly 0 (α = 0 makes φ and δ uncorrelated) is estimated from products of O(1) values.
      rounding = 1e-6 * np.abs(exact[t]).max()
      assert abs(mean - exact[t, a, b]) <= 4 * se + rounding, (t, (a, b), mean, exact[t, a, b], se)


@pytest.mark.parametrize("alpha,gamma,group_size", [(0.5, 0.7, 2), (0.9, 0.3, 2), (0.9, 0.7, 4)])
def test_noise_driven_spread_matches_the_second_moment_recursion(alpha, gamma, group_size):
  beta, noise, rounds = 0.7, 1.0, 12
  mc = _monte_carlo(alpha=alpha, beta=beta, gamma=gamma, group_size=group_size, rounds=rounds, noise=noise,
                    init=0.0, seed=1)
  exact = second_moments(rounds, np.zeros((2, 2)), alpha=alpha, beta=beta, gamma=gamma,
                                   group_size=group_size, num_replicas=N, noise_var=noise)
  _check_against_exact(mc, exact, [1, 2, 4, rounds])


@pytest.mark.parametrize("alpha,gamma", [(0.9, 1.2), (0.5, 0.7), (0.0, 1.0)])
def test_homogeneous_spread_grows_or_shrinks_as_the_spectral_radius_says(alpha, gamma):
  rounds = 10
  mc = _monte_carlo(alpha=alpha, beta=0.7, gamma=gamma, group_size=2, rounds=rounds, noise=0.0, init=1.0, seed=2)
  # The initial deviations are independent N(0, 1) for φ and δ: C0 = I (up to the projection).
  exact = second_moments(rounds, np.eye(2), alpha=alpha, beta=0.7, gamma=gamma, group_size=2,
                                   num_replicas=N)
  _check_against_exact(mc, exact, [1, 3, rounds])
  rho = stability.spectral_radius(alpha, gamma, 2, N)
  ratio = mc[rounds, 0].mean() / mc[rounds - 4, 0].mean()
  assert abs(ratio ** 0.25 / rho - 1) < 0.1, (ratio ** 0.25, rho)


def test_the_issues_examples():
  # α = 0.9, γ = 1.2 is inside the paper's interval, yet the spread grows; α = 0.9, γ = 0.3 is outside it
  # and converges.
  low, high = stability.paper_interval(0.9, 2)
  assert low < 1.2 < high and not low < 0.3 < high
  assert stability.spectral_radius(0.9, 1.2, 2, 8) > 1
  assert 1.05 < stability.spread_growth_per_round(0.9, 1.2, 2, 8) < 1.15
  assert stability.spectral_radius(0.9, 0.3, 2, 8) < 1
  # The defaults (α = 0.5, β = γ = 0.7) are stable; pure gossip shrinks the variance by a = 3/7 per round.
  assert stability.spectral_radius(0.5, 0.7, 2, 8) < 1
  assert stability.spectral_radius(0.0, 1.0, 2, 8) == pytest.approx(3 / 7)
  assert stability.stationary_second_moments(alpha=0.9, beta=0.7, gamma=1.2, group_size=2, num_replicas=8) is None


def test_the_map_agrees_with_an_explicit_average_over_all_groupings():
  """E over every grouping of 6 replicas into pairs of M C⊗Q Mᵀ, computed on 12×12 matrices."""
  alpha, beta, gamma, lam, n6 = 0.7, 0.6, 0.9, 0.3, 6
  Q = np.eye(n6) - 1 / n6
  C = np.array([[1.0, 0.3], [0.3, 0.5]])
  B0, B1 = stability._blocks(alpha, beta, gamma, lam)  # pylint: disable=protected-access
  groupings = set()
  for t in range(4000):  # the 15 pairings of 6 replicas, all reached
    groupings.add(frozenset(frozenset(g) for g in pairing.PairingSchedule(
        seed=0, num_replicas=n6, group_size=2).groups(t)))
  assert len(groupings) == 15
  total = np.zeros((2 * n6, 2 * n6))
  for grouping in groupings:
    A = np.zeros((n6, n6))
    for g in grouping:
      for i in g:
        for j in g:
          A[i, j] = 0.5
    M = np.kron(B0, np.eye(n6)) + np.kron(B1, A)
    total += M @ np.kron(C, Q) @ M.T / len(groupings)
  L = stability.second_moment_map(alpha, gamma, 2, n6, beta=beta, inner_contraction=lam)
  want = np.kron((L @ C.reshape(4)).reshape(2, 2), Q)
  np.testing.assert_allclose(total, want, atol=1e-12)


def test_instability_message_names_the_values():
  assert stability.instability(0.5, 0.7, 2, 8) is None and stability.instability(0.9, 0.3, 2, 8) is None
  message = stability.instability(0.9, 1.2, 2, 8)
  assert "outer.rule.consensus_weight=1.2" in message and "11.4% per round" in message and "inside" in message
