"""The outer methods behind config.outer.kind: one module per method, each its catalogue entry (a `Spec`,
base.py: what it reads, its defaults, checks, stability, bytes on the wire, abilities) beside its rule:
noloco.py (NoLoCo and gossip), diloco.py, epidemic.py, epidemic_adam.py, ddp.py, none.py (README.md's table).

The specs are read before JAX is imported (the package registers them with the config schema when it is
imported), so each method imports the JAX parts of its rule inside `build`: with main.py, the one place
where the package imports inside a function (scripts/import_graph.py: DEFERRED).

A new method is a `Spec` passed to `register` (docs/adding_an_outer_rule.md); tests/test_outer_nesterov.py
defines one in the test itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from noloco_jax.config import outer as outer_schema
from noloco_jax.config.outer import OuterConfig
from noloco_jax.outer.methods import ddp, diloco, epidemic, epidemic_adam, noloco, none
from noloco_jax.outer.methods.base import Spec, Unstable


def register(spec: Spec) -> None:
  """Makes `spec.kind` a valid config.outer.kind."""
  outer_schema.register(spec)


for _spec in (noloco.NOLOCO, diloco.DILOCO, noloco.GOSSIP, epidemic.EPIDEMIC, epidemic_adam.EPIDEMIC_ADAM, ddp.DDP,
              none.NONE):
  register(_spec)


def get(kind: str) -> Spec:
  """The spec of `kind` (one line naming the field when there is none)."""
  return outer_schema.spec(kind)


def make(outer, optimizer=None):
  """The method of `config.outer` (typed, or a ConfigDict read through the schema): its spec's `build`, its
  outer state stored in outer.state_dtype (outer/base.with_state_dtype).

  `optimizer`: the inner optimizer without clipping (inner.make_optimizer(clip=False)), for a method whose
  round steps it (epidemic_adam).
  """
  from noloco_jax.outer import base  # pylint: disable=g-import-not-at-top  (JAX: the module docstring says why)
  o = OuterConfig.parse(outer)
  method = base.with_state_dtype(o.spec.build(o, optimizer), o.state_dtype)
  return dataclasses.replace(method, traffic=lambda params, n: o.spec.wire(method.message_bytes(params), n, o))


def schedule(outer, *, seed: int, num_replicas: int):
  """Who exchanges with whom in each round of the lock-step schedule, a pure function of (seed, round); None
  for a method whose rounds need no schedule."""
  o = OuterConfig.parse(outer)
  return o.spec.schedule(o, seed, num_replicas) if o.spec.schedule is not None else None


def defaults(kind: str) -> dict[str, Any]:
  """`config.outer` fields of method `kind` at its defaults (the paper's for the methods the paper runs),
  as a nested dict to update a config with: configs/paper.py and the notebooks' sweeps take them from here."""
  spec = get(kind)
  rule = {k: v for k, v in spec.defaults.items() if k != "inner_steps"}
  out: dict[str, Any] = {"kind": kind, "rule": rule}
  if "inner_steps" in spec.defaults:
    out["inner_steps"] = spec.defaults["inner_steps"]
  return out


__all__ = ["Spec", "Unstable", "defaults", "get", "make", "register", "schedule"]
