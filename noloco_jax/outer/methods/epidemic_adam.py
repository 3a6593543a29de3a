"""The NoLoCo reference code's Epidemic Learning variant (`outer.kind=epidemic_adam`; docs/compression.md).

Not de Vos et al.'s rule (that is `epidemic`): every H steps the replicas are cut into random groups of
n = config.outer.rule.group_size (NoLoCo's draw), each group's mean of the fast weights is formed (n − 1
ppermutes of θ in config.outer.codec.message_dtype), and every replica takes one more step of its own inner
optimizer, unclipped, with the disagreement as the gradient:

    g_i = θ_i − mean_G θ;     (u_i, s_i) = Adam(g_i, s_i);     θ_i ← θ_i + u_i

so the pull towards the group is Adam-normalised, and the optimizer's count runs one step ahead per
round. `state.step` is not advanced; there is no slow state (`outer["slow"]` is θ after the round). The
paper does not run it: it gets NoLoCo's H and pairs. Its stability is not analysed.
"""

from __future__ import annotations

from noloco_jax.outer.methods import noloco
from noloco_jax.outer.methods.base import Spec


def build(outer, optimizer=None):
  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  import jax
  import optax
  from noloco_jax.outer import base, exchange
  if optimizer is None:
    raise ValueError(f"outer.kind={outer.kind!r} steps the inner optimizer: pass methods.make(..., optimizer=).")
  dtype = base.MESSAGE_DTYPES[outer.codec.message_dtype]

  def one_replica(params, opt_state, mean):
    disagreement = jax.tree.map(lambda t, m: (t.astype(m.dtype) - m).astype(t.dtype), params, mean)
    updates, opt_state = optimizer.update(disagreement, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def make_round(pool, num_devices):
    if pool is None and num_devices != 1:
      raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")

    def round_fn(states, route):
      metrics = {"pseudo_grad_norm": base.pseudo_grad_norm(states)}
      mean = exchange.plain_group_mean(states.params, pool, route, num_devices, dtype)  # float32
      theta, opt_state = jax.vmap(one_replica)(states.params, states.opt_state, mean)
      return states.replace(params=theta, opt_state=opt_state, outer={"slow": theta}), metrics
    return round_fn

  return base.OuterMethod(kind=outer.kind, init=lambda params: {"slow": params}, make_round=make_round,
                          new_replica=base.from_slow, message_bytes=lambda params: base.tree_bytes(params, dtype))


EPIDEMIC_ADAM = Spec(
    kind="epidemic_adam", build=build, wire=noloco.permute_wire, reads=("group_size", "inner_steps"),
    defaults=dict(group_size=2, inner_steps=50), not_in_paper="NoLoCo's H and group size", exchange=("message_dtype",),
    grouped=True, schedule=noloco.schedule)
