"""`none`: independent replicas, no outer step, nothing on the wire (the baseline of no communication)."""

from __future__ import annotations

from noloco_jax.outer import wire
from noloco_jax.outer.methods.base import Spec


def build(outer, optimizer=None):
  from noloco_jax.outer import base  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  del optimizer
  return base.OuterMethod(kind=outer.kind, init=lambda params: ())


NONE = Spec(kind="none", build=build, wire=lambda message_bytes, num_replicas, outer: (wire.NOTHING, wire.NOTHING),
            rounds=False)
