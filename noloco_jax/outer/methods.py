"""Outer methods behind `config.outer.kind`, all through one interface (`OuterMethod`).

| kind     | every step              | every H steps (a round)                                  | sends per replica       |
|----------|-------------------------|----------------------------------------------------------|-------------------------|
| `noloco` | local Adam              | group mean of c = βθ + (γ−β)φ over a random group of n   | (n−1) × model, ppermute |
| `gossip` | local Adam              | NoLoCo with α=0, β=γ=1: φ ← mean_G θ (pairwise averaging) | (n−1) × model, ppermute |
| `epidemic` | local Adam            | θ ← mean of own θ and those from random senders (epidemic.py) | s × model, ppermute   |
| `epidemic_adam` | local Adam       | one more inner-optimizer step along θ − mean_G θ (epidemic_adam.py) | (n−1) × model, ppermute |
| `diloco` | local Adam              | all-reduce of φ − θ, outer SGD heavy-ball or Nesterov     | model, all-reduce       |
| `ddp`    | Adam on averaged grads  | nothing                                                   | model every step        |
| `none`   | local Adam              | nothing (independent replicas)                            | nothing                 |

A method's round function runs inside `shard_map` over `replica` and sees the k replicas of one device
stacked (see mesh.replica_map). Communication: NoLoCo and gossip through exchange.py (ppermutes within
the groups, no all-reduce); DiLoCo's all-reduce and DDP's gradient average are the `jax.lax.pmean` over
`replica` in this file (`_mean_over_replicas`). NoLoCo and gossip with plain messages also come cut in
two (`OverlapRule`: message, send, merge) for streaming overlap (outer/overlap.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from noloco_jax.config.outer import KINDS, OuterConfig
from noloco_jax.parallel.mesh import REPLICA
from noloco_jax.outer import coded as coded_lib, compression, epidemic, epidemic_adam, exchange, rules
from noloco_jax.outer.pairing import Groups, PairingSchedule
from noloco_jax.inner.state import TrainState

# The dtypes of config.outer.message_dtype (noloco_jax/config/outer.py: MESSAGE_DTYPES).
MESSAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class OverlapRule:
  """A round cut in two for streaming overlap (`outer.overlap_steps` > 0; outer/overlap.py runs it).

  Each callable works on the k replicas of one device, inside the replica shard_map. Only `send`
  communicates; it reads the message alone, never the state, so the inner steps that run while it is
  in flight (and donate the state) do not wait for it.
  """
  message: Callable  # states_k -> (c_k in float32, metrics_k): the round's message, at its start
  make_send: Callable  # (pool, num_devices) -> send(c_k, route) -> mean_G(c)_k in float32
  merge: Callable  # (states_k, mean_c_k) -> states_k: the rule, applied τ steps late, and the mix


@dataclasses.dataclass(frozen=True)
class OuterMethod:
  kind: str
  has_rounds: bool  # whether an outer step runs every H inner steps
  uses_pairing: bool  # whether rounds need a PairingSchedule
  init: Callable  # params of one replica -> outer state of one replica
  reduce_grads: Callable | None  # inside shard_map, on the [k, ...] gradient stack (ddp only)
  # make_round(pool, num_devices) -> round(states_k, route) -> (states_k, metrics_k). `route` is the
  # int32 index into `pool` (the groupings the program covers), or, with pool=None on one device, the
  # round's [n−1, N] source table (pairing.source_table): the grouping as data, one program for all.
  make_round: Callable[[tuple[Groups, ...] | None, int], Callable] | None
  bytes_per_round: Callable  # params of one replica -> bytes each replica puts into collectives per round
  bytes_per_step: Callable  # params of one replica -> bytes per inner step (ddp)
  overlap: OverlapRule | None = None  # noloco / gossip with plain messages: the round cut in two
  # params of one replica -> bytes of the one message its exchange carries (a model copy in the message
  # dtype, the codec's payload, DiLoCo's float32 pseudo-gradient, DDP's gradients): outer/wire.py prices
  # it on the wire, sent and received, under the config's all-reduce algorithm.
  message_bytes: Callable = lambda params: 0


def tree_bytes(tree, dtype=None) -> int:
  """Bytes of a pytree of arrays (or shape structs), optionally as if cast to `dtype`."""
  return int(sum(np.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _pseudo_grad_norm(states: TrainState):
  return jax.vmap(optax.tree.norm)(rules.pseudo_gradient(states.params, states.outer["slow"]))


def _slow_and_momentum(params):
  return {"slow": params, "momentum": jax.tree.map(jnp.zeros_like, params)}


def _noloco(alpha: float, beta: float, gamma: float, group_size: int, message_dtype, kind: str,
            coded: coded_lib.CodedMessage | None = None, mix: float = 0.5) -> OuterMethod:
  if coded is not None:  # outer.compression != none: see coded.py and docs/compression.md
    def init(params):
      residual = coded.init_residual(params)
      return {**_slow_and_momentum(params), **({"residual": residual} if residual is not None else {})}

    return OuterMethod(
        kind=kind, has_rounds=True, uses_pairing=True, init=init, reduce_grads=None,
        make_round=lambda pool, num_devices: coded_lib.make_round(
            coded, alpha=alpha, beta=beta, gamma=gamma, pool=pool, num_devices=num_devices),
        bytes_per_round=lambda params: (group_size - 1) * coded.payload_bytes(params),
        bytes_per_step=lambda params: 0, message_bytes=coded.payload_bytes)

  def make_round(pool, num_devices):
    if pool is None and num_devices != 1:
      raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")

    def round_fn(states: TrainState, route):
      theta, phi, delta = states.params, states.outer["slow"], states.outer["momentum"]
      metrics = {"pseudo_grad_norm": _pseudo_grad_norm(states)}
      c = rules.noloco_message(theta, phi, beta=beta, gamma=gamma)
      mean_c = exchange.group_mean_for_round(c, pool, route, num_devices, message_dtype)
      theta, phi, delta = rules.noloco_update(phi, delta, mean_c, alpha=alpha, gamma=gamma)
      return states.replace(params=theta, outer={"slow": phi, "momentum": delta}), metrics
    return round_fn

  # The same round cut in two for streaming overlap (outer/overlap.py): the message and the group mean
  # are exactly the lines above; the rule runs τ steps later, on the state as it is then.
  def message(states: TrainState):
    metrics = {"pseudo_grad_norm": _pseudo_grad_norm(states)}
    return rules.noloco_message(states.params, states.outer["slow"], beta=beta, gamma=gamma), metrics

  def make_send(pool, num_devices):
    if pool is None and num_devices != 1:
      raise ValueError("a grouping passed as data (pool=None) needs one device; a mesh needs static groupings.")
    return lambda c, route: exchange.group_mean_for_round(c, pool, route, num_devices, message_dtype)

  def merge(states: TrainState, mean_c):
    theta, phi, delta = rules.noloco_delayed_merge(states.params, states.outer["slow"], states.outer["momentum"],
                                                   mean_c, alpha=alpha, gamma=gamma, mix=mix)
    return states.replace(params=theta, outer={"slow": phi, "momentum": delta})

  return OuterMethod(
      kind=kind, has_rounds=True, uses_pairing=True, init=_slow_and_momentum, reduce_grads=None,
      make_round=make_round,
      bytes_per_round=lambda params: (group_size - 1) * tree_bytes(params, message_dtype),
      bytes_per_step=lambda params: 0, overlap=OverlapRule(message=message, make_send=make_send, merge=merge),
      message_bytes=lambda params: tree_bytes(params, message_dtype))


def _epidemic(fanout: int, message_dtype) -> OuterMethod:
  return OuterMethod(
      kind="epidemic", has_rounds=True, uses_pairing=True, init=lambda params: {"slow": params},
      reduce_grads=None, make_round=lambda pool, num_devices: epidemic.make_round(pool, num_devices, message_dtype),
      bytes_per_round=lambda params: fanout * tree_bytes(params, message_dtype), bytes_per_step=lambda params: 0,
      message_bytes=lambda params: tree_bytes(params, message_dtype))


def _epidemic_adam(group_size: int, message_dtype, optimizer: optax.GradientTransformation | None) -> OuterMethod:
  if optimizer is None:
    raise ValueError("outer.kind='epidemic_adam' steps the inner optimizer: pass make_method(..., optimizer=).")
  return OuterMethod(
      kind="epidemic_adam", has_rounds=True, uses_pairing=True, init=lambda params: {"slow": params},
      reduce_grads=None,
      make_round=lambda pool, num_devices: epidemic_adam.make_round(pool, num_devices, message_dtype, optimizer),
      bytes_per_round=lambda params: (group_size - 1) * tree_bytes(params, message_dtype),
      bytes_per_step=lambda params: 0, message_bytes=lambda params: tree_bytes(params, message_dtype))


def _mean_over_replicas(x_k):
  """Mean over all N replicas of a [k, ...] stack: local mean, then one all-reduce over `replica`."""
  return jnp.broadcast_to(jax.lax.pmean(jnp.mean(x_k, axis=0), REPLICA), x_k.shape)


def _diloco(lr: float, momentum: float, nesterov: bool) -> OuterMethod:
  transform = rules.diloco_transform(lr=lr, momentum=momentum, nesterov=nesterov)

  def init(params):
    return {"slow": params, "opt": transform.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))}

  def make_round(pool, num_devices):
    del pool, num_devices  # an all-reduce needs no pairing

    def round_fn(states: TrainState, route):
      del route
      theta, phi = states.params, states.outer["slow"]
      metrics = {"pseudo_grad_norm": _pseudo_grad_norm(states)}
      # The one global collective of DiLoCo: every replica contributes its float32 pseudo-gradient.
      mean_g = jax.tree.map(_mean_over_replicas, rules.pseudo_gradient(theta, phi))
      theta, phi, opt = jax.vmap(lambda p, o, g: rules.diloco_update(p, o, g, transform))(
          phi, states.outer["opt"], mean_g)
      return states.replace(params=theta, outer={"slow": phi, "opt": opt}), metrics
    return round_fn

  return OuterMethod(
      kind="diloco", has_rounds=True, uses_pairing=False, init=init, reduce_grads=None,
      make_round=make_round, bytes_per_round=lambda params: tree_bytes(params, jnp.float32),
      bytes_per_step=lambda params: 0, message_bytes=lambda params: tree_bytes(params, jnp.float32))


def _ddp() -> OuterMethod:
  def reduce_grads(grads):
    return jax.tree.map(_mean_over_replicas, grads)

  return OuterMethod(
      kind="ddp", has_rounds=False, uses_pairing=False, init=lambda params: (), reduce_grads=reduce_grads,
      make_round=None, bytes_per_round=lambda params: 0, bytes_per_step=lambda params: tree_bytes(params),
      message_bytes=lambda params: tree_bytes(params))


def _none() -> OuterMethod:
  return OuterMethod(
      kind="none", has_rounds=False, uses_pairing=False, init=lambda params: (), reduce_grads=None,
      make_round=None, bytes_per_round=lambda params: 0, bytes_per_step=lambda params: 0)


def _coded(outer_cfg: OuterConfig) -> coded_lib.CodedMessage | None:
  """The compressed-message codec of `outer.compression`, or None for plain `message_dtype` messages."""
  if outer_cfg.compression == "none":
    return None
  return coded_lib.CodedMessage(
      compression_kind=outer_cfg.compression, chunk=outer_cfg.compression_chunk, density=outer_cfg.topk_density,
      bits=outer_cfg.topk_bits, slow_codec=outer_cfg.slow_codec, feedback_decay=outer_cfg.feedback_decay)


def make_method(outer_cfg: ml_collections.ConfigDict | OuterConfig,
                optimizer: optax.GradientTransformation | None = None) -> OuterMethod:
  """The method of `config.outer` (read through its schema: old field names map to the new ones).

  `optimizer`: the inner optimizer without clipping (inner.make_optimizer(clip=False)); only
  `epidemic_adam`, whose round steps it, needs one.
  """
  outer_cfg = OuterConfig.parse(outer_cfg)
  kind = outer_cfg.kind
  if kind == "noloco":
    return _noloco(outer_cfg.outer_momentum, outer_cfg.outer_lr, outer_cfg.consensus_weight, outer_cfg.group_size,
                   MESSAGE_DTYPES[outer_cfg.message_dtype], kind, _coded(outer_cfg), outer_cfg.overlap_mix)
  if kind == "gossip":
    # The momentum ablation: pure pairwise averaging of the fast weights, φ ← mean_G θ.
    return _noloco(0.0, 1.0, 1.0, outer_cfg.group_size, MESSAGE_DTYPES[outer_cfg.message_dtype], kind,
                   _coded(outer_cfg), outer_cfg.overlap_mix)
  if kind == "epidemic":
    return _epidemic(outer_cfg.fanout, MESSAGE_DTYPES[outer_cfg.message_dtype])
  if kind == "epidemic_adam":
    return _epidemic_adam(outer_cfg.group_size, MESSAGE_DTYPES[outer_cfg.message_dtype], optimizer)
  if kind == "diloco":
    return _diloco(outer_cfg.outer_lr, outer_cfg.outer_momentum, outer_cfg.nesterov)
  if kind == "ddp":
    return _ddp()
  if kind == "none":
    return _none()
  raise ValueError(f"outer.kind={kind!r} is not valid; choose one of {KINDS}.")


def make_schedule(config: ml_collections.ConfigDict) -> PairingSchedule | epidemic.EpidemicSchedule:
  if config.outer.kind == "epidemic":
    return epidemic.EpidemicSchedule(seed=config.seed, num_replicas=config.num_replicas,
                                     fanout=config.outer.fanout, mode=config.outer.pairing)
  return PairingSchedule(seed=config.seed, num_replicas=config.num_replicas,
                         group_size=config.outer.group_size, mode=config.outer.pairing)
