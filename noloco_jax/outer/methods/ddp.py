"""Data-parallel training (`ddp`): every replica steps its inner optimizer on the mean of all replicas'
gradients (an all-reduce over `replica` every step, in the parameters' dtype, priced on the wire under
config.outer.rule.allreduce_algorithm), so the replicas stay identical; no outer rounds."""

from __future__ import annotations

from noloco_jax.outer import wire
from noloco_jax.outer.methods.base import Spec, identical_replicas


def build(outer, optimizer=None):
  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  import jax
  from noloco_jax.outer import base
  del optimizer
  return base.OuterMethod(kind=outer.kind, init=lambda params: (),
                          reduce_grads=lambda grads: jax.tree.map(base.mean_over_replicas, grads),
                          message_bytes=base.tree_bytes)


def step_wire(message_bytes: int, num_replicas: int, outer):
  return wire.NOTHING, wire.allreduce(message_bytes, num_replicas, outer.rule.allreduce_algorithm)


DDP = Spec(kind="ddp", build=build, wire=step_wire, exchange=("allreduce_algorithm",), rounds=False,
           stability=identical_replicas)
