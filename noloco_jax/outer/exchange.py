"""The exchange of a round: what a replica sends (a codec's payload), where it goes, and the group mean.

A round's message travels through one `MessageCodec`: `encode` turns a replica's message into the
payload that crosses the network, `decode` turns a received payload back into float32. The plain codec
is a cast to `outer.codec.message_dtype`; the compressed codecs (`outer.codec.compression` int8 / int4 / topk, with
error feedback; docs/compression.md) quantise or sparsify. The codec is a parameter of the exchange,
not a second round: the same exchange moves any payload, so compression composes with streaming
overlap and with every pairing plan.

Moving one tensor per replica, inside `shard_map` over the `replica` axis: the primitive is
`route(x_k, src)`: global replica g receives x from replica src[g]. A device holds k consecutive
replicas (global index g = device * k + slot), so a route is a set of slot moves, carried out by
parallel/collectives.move_slots (one ppermute per (source slot, destination slot) pair, a local gather
for moves within a device): each replica sends exactly one copy of its payload. With one device (the
simulator), the whole route is a gather. Both paths only move values and decode with the same code,
so they give the same numbers.

No all-reduce appears anywhere: a group mean over n members is n−1 routes (pairing.sources_for_shift).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.outer import compression
from noloco_jax.outer.pairing import Groups, sources_for_shift
from noloco_jax.parallel import collectives
from noloco_jax.parallel.mesh import REPLICA


def route(x_k: jax.Array, src: Sequence[int], num_devices: int) -> jax.Array:
  """x_k: this device's [k, ...] stack. Returns the [k, ...] stack of what each local replica receives."""
  k = x_k.shape[0]
  src = np.asarray(src)
  if num_devices == 1:
    return x_k[src]
  moves = [(int(src[g]) // k, int(src[g]) % k, g // k, g % k) for g in range(len(src))]
  return collectives.move_slots(x_k, moves, REPLICA, num_devices)


# ---------------------------------------------------------------------------------------------------
# Codecs: how a message travels.
# ---------------------------------------------------------------------------------------------------


def _f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def message(theta, phi, *, beta: float, gamma: float):
  """c = β·θ + (γ − β)·φ, in float32: the one tensor a replica of NoLoCo's family sends to its group (since
  β·mean_G(θ − φ) + γ·mean_G φ = mean_G(c)); the top-k codec sends its parts β·(θ − φ) and γ·φ apart."""
  return jax.tree.map(lambda t, p: beta * t.astype(jnp.float32) + (gamma - beta) * p.astype(jnp.float32),
                      theta, phi)


@dataclasses.dataclass(frozen=True)
class PlainCodec:
  """The message as it is, cast to `dtype` on the wire (float32 or bfloat16); received values in float32."""
  dtype: Any = jnp.float32
  feedback: bool = False  # no residual: nothing is lost but the cast

  def init_residual(self, params):
    del params
    return None

  def encode(self, message, residual):
    """One replica's float32 message -> (payload, residual); the payload is what crosses the network."""
    del residual
    return jax.tree.map(lambda x: x.astype(self.dtype), message), None

  def decode(self, payload, like):
    del like
    return _f32(payload)

  def payload_bytes(self, params) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(self.dtype).itemsize for x in jax.tree.leaves(params)))


class CompressedCodec:
  """`outer.codec.compression` (int8 | int4 | topk) with error feedback (docs/compression.md).

  The message c = β·θ + (γ − β)·φ is written c = β·(θ − φ) + γ·φ: a fresh, small part (the round's
  pseudo-gradient, scaled by β) and a large, slowly moving part (the slow weights). Pairs change every
  round, so a receiver holds none of its new partner's past messages and nothing is sent as a
  difference:
  - int8 / int4: the whole message m = c + e is quantised per chunk;
  - topk: only the fresh part m = β·(θ − φ) + e is sparsified (top-k per chunk, b-bit values), as
    SparseLoCo does with pseudo-gradients; the γ·φ part travels densely with `outer.codec.slow_codec`.
  e is the error-feedback residual (decayed by `outer.codec.feedback_decay`, 0 = off): what was not sent
  this round is added to the next round's message, to whichever partner that goes. `encode` takes θ and
  φ beside c, so that top-k can tell the two parts apart.
  """

  def __init__(self, *, kind: str, chunk: int, density: float, bits: int, slow_codec: str, feedback_decay: float):
    self.kind, self.decay, self.feedback = kind, feedback_decay, feedback_decay > 0
    if kind == "topk":
      self.fresh = compression.Codec("topk", chunk=chunk, density=density, bits=bits)
      self.slow = compression.Codec(slow_codec, chunk=chunk)
    else:
      self.fresh, self.slow = compression.Codec(kind, chunk=chunk), None

  def init_residual(self, params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if self.feedback else None

  def encode(self, message, theta, phi, residual, *, beta: float, gamma: float):
    """One replica's message c (float32) and its θ, φ -> (payload, new residual or None)."""
    if self.slow is None:
      return compression.with_feedback(self.fresh, message, residual, self.decay)
    fresh = jax.tree.map(lambda t, p: beta * (t - p), _f32(theta), _f32(phi))
    fresh_payload, residual = compression.with_feedback(self.fresh, fresh, residual, self.decay)
    slow_payload = self.slow.encode(jax.tree.map(lambda p: gamma * p, _f32(phi)))
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


def encode_stack(codec, theta_k, phi_k, residual_k, *, beta: float, gamma: float):
  """The round's message for a [k, ...] stack of replicas: (own float32 c_k, payload_k, new residual_k or None).

  A replica's own term in its group mean is its exact c (it has it); only what it receives is decoded.
  """
  own = message(theta_k, phi_k, beta=beta, gamma=gamma)
  if isinstance(codec, PlainCodec):
    payload, _ = codec.encode(own, None)
    return own, payload, None
  # c is computed once: the codec encodes the very values the replica's own term holds.
  encode = lambda c, t, p, e: codec.encode(c, t, p, e, beta=beta, gamma=gamma)
  if residual_k is None:
    payload, _ = jax.vmap(lambda c, t, p: encode(c, t, p, None))(own, theta_k, phi_k)
    return own, payload, None
  payload, residual_k = jax.vmap(encode)(own, theta_k, phi_k, residual_k)
  return own, payload, residual_k


def decoder(codec, like_k) -> Callable:
  """decode for a [k, ...] stack of received payloads; `like_k` has the stacked shapes of a message."""
  if isinstance(codec, PlainCodec):
    return _f32  # elementwise: the stack decodes as one
  one = jax.tree.map(lambda x: x[0], like_k)
  return jax.vmap(lambda p: codec.decode(p, one))


# ---------------------------------------------------------------------------------------------------
# The group mean: what each replica receives (values moved only), then its own float32 term plus every
# received payload decoded, in a fixed order.
# ---------------------------------------------------------------------------------------------------


def _receive_static(payload, groups: Groups, num_devices: int) -> tuple:
  """What each replica receives at shifts 1 … n−1 for one static grouping (ppermutes on a mesh, gathers
  on one device)."""
  n = len(groups[0])
  num_replicas = sum(len(g) for g in groups)
  return tuple(jax.tree.map(lambda x, src=sources_for_shift(groups, shift, num_replicas): route(x, src, num_devices),
                            payload) for shift in range(1, n))


def _receive_gathers(payload, tables) -> tuple:
  """One device: `tables` [n−1, N] (traced) says whom each replica receives from at each shift."""
  return tuple(jax.tree.map(lambda x, src=tables[s]: x[src], payload) for s in range(tables.shape[0]))


def receive(payload, pool: Sequence[Groups] | None, route_arg, num_devices: int) -> tuple:
  """What each replica receives in a round program built for `pool` (the groupings it covers): a tuple of
  n−1 payload stacks, shift 1 … n−1 (pairing.sources_for_shift). Only values move, nothing is computed:

  - pool None (one device): `route_arg` is the round's [n−1, N] source table (pairing.source_table),
    traced: the grouping is data, one program serves every round;
  - a pool of one grouping: its static routes;
  - a pool of several: `route_arg` is the traced index into it. On a mesh each grouping is its own set
    of static ppermutes, chosen by `lax.switch` (only the chosen branch sends); on one device the routes
    are gathers whose tables are indexed by it, so no branches are needed.
  """
  if pool is None:
    if num_devices != 1:
      raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")
    return _receive_gathers(payload, route_arg)
  if len(pool) == 1:
    return _receive_static(payload, pool[0], num_devices)
  if num_devices == 1:
    n = len(pool[0][0])
    num_replicas = sum(len(g) for g in pool[0])
    tables = jnp.asarray([[sources_for_shift(g, s, num_replicas) for s in range(1, n)] for g in pool])
    return _receive_gathers(payload, tables[route_arg])
  branches = [lambda p, g=g: _receive_static(p, g, num_devices) for g in pool]
  return jax.lax.switch(route_arg, branches, payload)


def mean_of(own_f32, received, decode, weights=None):
  """Each replica's group mean: its own float32 term, then each received payload decoded (in the order
  received: shift 1 … n−1, or the group's members after this one), summed in float32 in that fixed order,
  divided by n.

  `weights` (the asynchronous schedule's staleness weights, own first; NumPy or traced): Σ_k w_k·c_k / Σ_k w_k,
  summed in the same order. None means all equal: then the sum is divided by the constant n (XLA:CPU turns
  that into a multiplication by 1/n, so a division by a computed Σ w = n would differ in the last bit).
  """
  if weights is None:
    total = own_f32
    for payload in received:
      total = jax.tree.map(jnp.add, total, decode(payload))
    return jax.tree.map(lambda t: t / (len(received) + 1), total)
  if len(received) + 1 != len(weights):
    raise ValueError(f"{len(received) + 1} messages but {len(weights)} weights.")
  w = jnp.asarray(weights, jnp.float32)
  total, norm = jax.tree.map(lambda c: w[0] * c, own_f32), w[0]
  for k, payload in enumerate(received, start=1):
    total = jax.tree.map(lambda t, c, k=k: t + w[k] * c, total, decode(payload))
    norm = norm + w[k]
  return jax.tree.map(lambda t: t / norm, total)


def plain_group_mean(tree, pool: Sequence[Groups] | None, route_arg, num_devices: int, message_dtype):
  """Mean over each replica's group of a pytree of [k, ...] leaves, sent in `message_dtype` (the own term
  stays in float32): the group mean with the plain codec, for rules that average θ itself (epidemic_adam)."""
  payload, _ = PlainCodec(message_dtype).encode(tree, None)
  return mean_of(_f32(tree), receive(payload, pool, route_arg, num_devices), _f32)


# ---------------------------------------------------------------------------------------------------
# The mean over a directed graph: a push to a few peers (Epidemic Learning), as a set of matchings.
# ---------------------------------------------------------------------------------------------------


def _local(table_N: np.ndarray, k: int, num_devices: int):
  """The [k] entries of an [N] host table that belong to this device's replicas."""
  if num_devices == 1:
    return jnp.asarray(table_N)
  return jax.lax.dynamic_slice_in_dim(jnp.asarray(table_N), jax.lax.axis_index(REPLICA) * k, k)


def graph_mean(tree, graph: Sequence[Sequence[int]], num_devices: int, message_dtype):
  """Each replica's average of its own leaves and those it receives along `graph` ([k, ...] leaves): one
  route per matching (matching[g] = the replica g receives from, or −1), each edge sent once."""
  k = jax.tree.leaves(tree)[0].shape[0]
  total = _f32(tree)
  sent = jax.tree.map(lambda x: x.astype(message_dtype), tree)
  count = jnp.ones((k,), jnp.float32)
  for matching in graph:
    src = np.asarray(matching)
    receives = src >= 0
    mask_k = _local(receives, k, num_devices)
    # Non-receivers route to themselves: a local copy that the mask drops, never a message.
    received = jax.tree.map(lambda x: route(x, np.where(receives, src, np.arange(len(src))), num_devices), sent)
    expand = lambda m, x: m.reshape((k,) + (1,) * (x.ndim - 1))
    total = jax.tree.map(lambda t, r: t + jnp.where(expand(mask_k, r), r.astype(jnp.float32), 0.0), total, received)
    count = count + mask_k
  return jax.tree.map(lambda t: t / count.reshape((k,) + (1,) * (t.ndim - 1)), total)
