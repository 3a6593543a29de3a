"""The arithmetic of the outer updates, for one replica, with no communication (docs/method.md §1).

Every function is elementwise over a pytree, so it applies unchanged to a stack of replicas. Updates
run in float32 whatever the parameter dtype; results are cast back to the dtypes they came in.

NoLoCo, with the corrected sign (+β, as the paper's appendix Eq. 32 and the reference code):
    δ ← α·δ + β·mean_G(θ − φ) + γ·(mean_G φ − φ_i);   φ ← φ + δ;   θ ← φ
Only one tensor per member has to cross the network, because
    β·mean_G(θ − φ) + γ·mean_G φ = mean_G(c),   c = β·θ + (γ − β)·φ,
so the update is  δ ← α·δ + mean_G(c) − γ·φ_i.   The momentum is heavy-ball (δ is added to φ as is).

With streaming overlap (outer.overlap_steps = τ > 0, docs/method.md §13) the same φ, δ update is applied
τ inner steps late, and the fast weights, which moved on meanwhile, are mixed rather than reset:
    θ ← λ·θ_local + (1 − λ)·φ_new        (λ = outer.overlap_mix)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _like(tree, reference):
  return jax.tree.map(lambda x, r: x.astype(r.dtype), tree, reference)


def noloco_message(theta, phi, *, beta: float, gamma: float):
  """c = β·θ + (γ − β)·φ: the one tensor a replica sends to its group (float32)."""
  return jax.tree.map(lambda t, p: beta * t.astype(jnp.float32) + (gamma - beta) * p.astype(jnp.float32),
                      theta, phi)


def noloco_update(phi, delta, mean_c, *, alpha: float, gamma: float):
  """Given mean_G(c): returns (θ, φ, δ) after the round; θ = φ."""
  new_delta = jax.tree.map(lambda d, m, p: alpha * d + m - gamma * p, _f32(delta), mean_c, _f32(phi))
  new_phi = jax.tree.map(lambda p, d: p + d, _f32(phi), new_delta)
  new_phi, new_delta = _like(new_phi, phi), _like(new_delta, delta)
  return new_phi, new_phi, new_delta


def noloco_delayed_merge(theta_local, phi, delta, mean_c, *, alpha: float, gamma: float, mix: float):
  """The merge of an exchange that arrives τ steps late: returns (θ, φ, δ).

  φ and δ follow `noloco_update` exactly (they depend only on the φ, δ and mean_G(c) of the round's
  start, which the inner steps never touch); θ ← mix·θ_local + (1 − mix)·φ_new, in float32.
  """
  new_phi, _, new_delta = noloco_update(phi, delta, mean_c, alpha=alpha, gamma=gamma)
  theta = jax.tree.map(lambda t, p: (mix * t.astype(jnp.float32) + (1.0 - mix) * p.astype(jnp.float32)).astype(t.dtype),
                       theta_local, new_phi)
  return theta, new_phi, new_delta


def pseudo_gradient(theta, phi):
  """φ − θ in float32: DiLoCo's outer 'gradient' (minus the local progress of the round)."""
  return jax.tree.map(lambda t, p: p.astype(jnp.float32) - t.astype(jnp.float32), theta, phi)


def diloco_transform(*, lr: float, momentum: float, nesterov: bool) -> optax.GradientTransformation:
  """Outer SGD with momentum on the averaged pseudo-gradient.

  Heavy-ball (reference: α=0.3, β=0.7): optax keeps m ← g + α·m and steps −β·m, which is the
  reference's δ ← α·δ + β·mean(θ − φ), φ ← φ + δ with δ = −β·m.
  Nesterov (original DiLoCo: lr 0.7, momentum 0.9): steps −β·(g + α·m).
  """
  return optax.sgd(learning_rate=lr, momentum=momentum if momentum > 0 else None, nesterov=nesterov)


def diloco_update(phi, opt_state, mean_pseudo_grad, transform: optax.GradientTransformation):
  """Given the all-reduced pseudo-gradient: returns (θ, φ, optimizer state); θ = φ."""
  updates, opt_state = transform.update(mean_pseudo_grad, opt_state, _f32(phi))
  new_phi = _like(jax.tree.map(lambda p, u: p + u, _f32(phi), updates), phi)
  return new_phi, new_phi, opt_state
