"""NoLoCo and gossip rounds whose messages travel compressed (`outer.compression`, docs/compression.md).

The uncompressed round sends c = β·θ + (γ − β)·φ. Written as
    c = β·(θ − φ) + γ·φ,
it has a fresh, small part (the round's pseudo-gradient, scaled by β) and a large, slowly moving part
(the slow weights). Pairs change every round, so a receiver holds none of its new partner's past
messages: a top-k of "the change since last round" would need a reference both sides share. We do not
keep per-peer references (2(N − 1) model copies per replica); instead:

- `int8` / `int4`: the whole message m = c + e is quantised per chunk;
- `topk`: only the fresh part m = β·(θ − φ) + e is sparsified (top-k per chunk, b-bit values), as
  SparseLoCo does with pseudo-gradients; the γ·φ part travels densely with `outer.slow_codec`
  (int8 by default). No reference is needed, because nothing is sent as a difference.

e is the error-feedback residual (decayed by `outer.feedback_decay`, zero = off): what was not sent
this round is added to the next round's message, to whichever partner that goes. A replica's own term
in the group mean is its exact c (it has it); only what it receives is decoded. Both the mesh and the
single-device paths route the same payload arrays and decode with the same code, so they agree bitwise.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from noloco_jax.outer import compression, exchange, rules
from noloco_jax.outer.pairing import Groups, sources_for_shift


def _group_mean(own_f32, payload, decode, groups: Groups, num_devices: int):
  """Mean over each replica's group: its own float32 tree plus the decoded payloads it receives."""
  n = len(groups[0])
  num_replicas = sum(len(g) for g in groups)
  total = own_f32
  for shift in range(1, n):
    src = sources_for_shift(groups, shift, num_replicas)
    received = jax.tree.map(lambda x: exchange.route(x, src, num_devices), payload)
    total = jax.tree.map(jnp.add, total, decode(received))
  return jax.tree.map(lambda t: t / n, total)


def group_mean_coded(own_f32, payload, decode, pool: Sequence[Groups] | None, route, num_devices: int):
  """exchange.group_mean_for_round for payload pytrees (any dtypes) and a [k, ...]-stacked `decode`.

  `route` is the traced index into `pool`, or, with pool=None on one device, the round's [n−1, N] source
  table (pairing.source_table): the grouping as data, one program for every round.
  """
  if pool is None:
    if num_devices != 1:
      raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")
    total = own_f32
    for s in range(route.shape[0]):  # n − 1 static shifts; each row gathers one partner per replica
      total = jax.tree.map(jnp.add, total, decode(jax.tree.map(lambda x, src=route[s]: x[src], payload)))
    return jax.tree.map(lambda t: t / (route.shape[0] + 1), total)
  index = route
  if len(pool) == 1:
    return _group_mean(own_f32, payload, decode, pool[0], num_devices)
  if num_devices == 1:  # routes are gathers; index their tables with the traced pool index
    n = len(pool[0][0])
    num_replicas = sum(len(g) for g in pool[0])
    tables = jnp.asarray([[sources_for_shift(g, s, num_replicas) for s in range(1, n)] for g in pool])
    total = own_f32
    for s in range(n - 1):
      src = tables[index, s]
      total = jax.tree.map(jnp.add, total, decode(jax.tree.map(lambda x: x[src], payload)))
    return jax.tree.map(lambda t: t / n, total)
  # On a mesh: one branch of static ppermutes per grouping; only the chosen branch sends.
  branches = [lambda o, p, g=g: _group_mean(o, p, decode, g, num_devices) for g in pool]
  return jax.lax.switch(index, branches, own_f32, payload)


class CodedMessage:
  """Encodes a [k, ...] stack of one round's messages and decodes what arrives (see module doc)."""

  def __init__(self, *, compression_kind: str, chunk: int, density: float, bits: int, slow_codec: str,
               feedback_decay: float):
    self.kind = compression_kind
    self.decay = feedback_decay
    self.feedback = feedback_decay > 0
    if compression_kind == "topk":
      self.fresh = compression.Codec("topk", chunk=chunk, density=density, bits=bits)
      self.slow = compression.Codec(slow_codec, chunk=chunk)
    else:
      self.fresh = compression.Codec(compression_kind, chunk=chunk)
      self.slow = None

  def init_residual(self, params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if self.feedback else None

  def encode(self, theta, phi, residual, *, beta: float, gamma: float):
    """One replica: (payload, new residual or None)."""
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    if self.slow is None:
      message = rules.noloco_message(theta, phi, beta=beta, gamma=gamma)
      return compression.with_feedback(self.fresh, message, residual, self.decay)
    fresh = jax.tree.map(lambda t, p: beta * (t - p), f32(theta), f32(phi))
    fresh_payload, residual = compression.with_feedback(self.fresh, fresh, residual, self.decay)
    slow_payload = self.slow.encode(jax.tree.map(lambda p: gamma * p, f32(phi)))
    return {"fresh": fresh_payload, "slow": slow_payload}, residual

  def decode(self, payload, like):
    """One replica's float32 message from its payload; `like` has one replica's shapes."""
    if self.slow is None:
      return self.fresh.decode(payload, like)
    return jax.tree.map(jnp.add, self.fresh.decode(payload["fresh"], like), self.slow.decode(payload["slow"], like))

  def payload_bytes(self, params) -> int:
    """Bytes of one replica's payload (one message to one partner)."""
    total = compression.payload_bytes(self.fresh, params)
    return total + (compression.payload_bytes(self.slow, params) if self.slow is not None else 0)


def make_round(coded: CodedMessage, *, alpha: float, beta: float, gamma: float, pool, num_devices: int):
  """The NoLoCo round of methods._noloco with a coded exchange; states.outer may hold 'residual'."""

  def round_fn(states, route):
    theta, phi, delta = states.params, states.outer["slow"], states.outer["momentum"]
    residual = states.outer.get("residual")
    metrics = {"pseudo_grad_norm": jax.vmap(optax.tree.norm)(rules.pseudo_gradient(theta, phi))}
    if residual is None:
      payload, _ = jax.vmap(lambda t, p: coded.encode(t, p, None, beta=beta, gamma=gamma))(theta, phi)
    else:
      payload, residual = jax.vmap(lambda t, p, e: coded.encode(t, p, e, beta=beta, gamma=gamma))(theta, phi, residual)
    one = jax.tree.map(lambda x: x[0], theta)
    decode = jax.vmap(lambda p: coded.decode(p, one))
    own = rules.noloco_message(theta, phi, beta=beta, gamma=gamma)
    mean_c = group_mean_coded(own, payload, decode, pool, route, num_devices)
    theta, phi, delta = rules.noloco_update(phi, delta, mean_c, alpha=alpha, gamma=gamma)
    outer = {"slow": phi, "momentum": delta}
    if residual is not None:
      outer["residual"] = jax.tree.map(lambda r, old: r.astype(old.dtype), residual, states.outer["residual"])
    return states.replace(params=theta, outer=outer), metrics

  return round_fn

