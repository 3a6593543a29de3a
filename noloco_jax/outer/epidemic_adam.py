"""The NoLoCo reference code's Epidemic Learning variant (`outer.kind=epidemic_adam`).

Not de Vos et al.'s rule (that is `outer.kind=epidemic`, epidemic.py): every H steps the replicas are
cut into random groups of n = `outer.group_size` (the same draw as NoLoCo's, outer/pairing.py), each
group's mean of the fast weights is formed, and every replica then takes one more step of its own
inner optimizer with the disagreement as the gradient:

    g_i = θ_i − mean_G θ;     (u_i, s_i) = Adam(g_i, s_i);     θ_i ← θ_i + u_i

So the pull towards the group is Adam-normalised: each coordinate moves by about the learning rate
whatever the size of the disagreement, and the Adam moments m, v carry the disagreement into the next
inner steps. Choices where the reference's description leaves room, and why:
- the optimizer is the inner one with its state s_i (same moments, same step count and schedule); its
  count therefore runs one step ahead per round (H + 1 updates per round), which moves the learning
  rate schedule by 1/H;
- no gradient clipping on this step (`inner.make_optimizer(clip=False)`, the same state tree): in a
  PyTorch loop clipping is applied to the backward pass's gradients, not inside `optimizer.step()`;
- the group mean travels as NoLoCo's messages do: n − 1 ppermutes of θ in `outer.message_dtype`
  within the group (no root gathers and scatters, which would send the same bytes twice);
- `state.step` (inner steps taken) is not advanced; there is no slow state, and `outer["slow"]` is
  θ after the round, so the logged outer/pseudo_grad_norm is ‖θ − θ_prev round‖ as for epidemic.
"""

from __future__ import annotations

import jax
import optax

from noloco_jax.outer import exchange, rules


def make_round(pool, num_devices: int, message_dtype, optimizer: optax.GradientTransformation):
  """round(states_k, route) -> (states_k, metrics) over the k replicas of one device."""
  if pool is None and num_devices != 1:
    raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")

  def one_replica(params, opt_state, mean):
    disagreement = jax.tree.map(lambda t, m: (t.astype(m.dtype) - m).astype(t.dtype), params, mean)
    updates, opt_state = optimizer.update(disagreement, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def round_fn(states, route):
    theta = states.params
    metrics = {"pseudo_grad_norm": jax.vmap(optax.tree.norm)(rules.pseudo_gradient(theta, states.outer["slow"]))}
    mean = exchange.plain_group_mean(theta, pool, route, num_devices, message_dtype)  # float32
    theta, opt_state = jax.vmap(one_replica)(theta, states.opt_state, mean)
    return states.replace(params=theta, opt_state=opt_state, outer={"slow": theta}), metrics

  return round_fn
