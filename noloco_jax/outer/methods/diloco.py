"""DiLoCo (Douillard et al., 2023), the all-reduce baseline: every H inner steps all replicas average their
pseudo-gradients φ − θ (one all-reduce over `replica`, float32) and every replica takes the same outer SGD
step with momentum on its slow weights φ; θ ← φ.

Heavy-ball (the NoLoCo reference's: α = 0.3, β = 0.7): optax keeps m ← g + α·m and steps −β·m, which is the
reference's δ ← α·δ + β·mean(θ − φ), φ ← φ + δ with δ = −β·m. Nesterov (original DiLoCo: lr 0.7, momentum
0.9): steps −β·(g + α·m). The outer optimizer is optax's (`outer_optimizer`): its state is `outer["opt"]`.

The replicas stay identical after every round (there is no spread to analyse). On the wire a round is one
all-reduce of the float32 pseudo-gradient, priced under config.outer.rule.allreduce_algorithm
(outer/wire.py).
"""

from __future__ import annotations

from noloco_jax.outer import wire
from noloco_jax.outer.methods.base import Spec, identical_replicas


def outer_optimizer(outer):
  """Outer SGD with momentum on the all-reduced pseudo-gradient (heavy-ball, or Nesterov)."""
  import optax  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  r = outer.rule
  return optax.sgd(learning_rate=r.outer_lr, momentum=r.outer_momentum if r.outer_momentum > 0 else None,
                   nesterov=r.nesterov)


def build(outer, optimizer=None):
  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  import jax
  import jax.numpy as jnp
  from noloco_jax.outer import base
  del optimizer
  transform = outer_optimizer(outer)

  def init(params):
    return {"slow": params, "opt": transform.init(base.f32(params))}

  def step(phi, opt_state, mean_pseudo_grad):
    """One replica: φ ← φ + the optimizer's update of the all-reduced pseudo-gradient; θ = φ."""
    updates, opt_state = transform.update(mean_pseudo_grad, opt_state, base.f32(phi))
    new_phi = jax.tree.map(lambda p, u, old: (p + u).astype(old.dtype), base.f32(phi), updates, phi)
    return new_phi, opt_state

  def make_round(pool, num_devices):
    del pool, num_devices  # an all-reduce needs no pairing

    def round_fn(states, route):
      del route
      metrics = {"pseudo_grad_norm": base.pseudo_grad_norm(states)}
      # The one global collective of DiLoCo: every replica contributes its float32 pseudo-gradient.
      mean_g = jax.tree.map(base.mean_over_replicas, base.pseudo_gradient(states.params, states.outer["slow"]))
      phi, opt = jax.vmap(step)(states.outer["slow"], states.outer["opt"], mean_g)
      return states.replace(params=phi, outer={"slow": phi, "opt": opt}), metrics
    return round_fn

  return base.OuterMethod(kind=outer.kind, init=init, make_round=make_round, new_replica=base.from_slow,
                          message_bytes=lambda params: base.tree_bytes(params, jnp.float32))


def allreduce_wire(message_bytes: int, num_replicas: int, outer):
  return wire.allreduce(message_bytes, num_replicas, outer.rule.allreduce_algorithm), wire.NOTHING


DILOCO = Spec(
    kind="diloco", build=build, wire=allreduce_wire, reads=("outer_momentum", "outer_lr", "nesterov", "inner_steps"),
    defaults=dict(outer_momentum=0.3, outer_lr=0.7, nesterov=False, inner_steps=100), in_paper=True,
    exchange=("allreduce_algorithm",), stability=identical_replicas)
