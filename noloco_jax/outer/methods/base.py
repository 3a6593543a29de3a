"""What a method declares about itself: its `Spec`, the catalogue entry beside its rule.

A spec is read before anything is built and before JAX is imported (the config's validation, main.py's
check of a command line, the end-of-run summary, the report): it says which config fields the method
reads and its values for them, what else it checks, its stability analysis, its bytes on the wire, and
what it can do. Its `build` makes the method itself (outer/base.OuterMethod, with JAX), when it is called.

What a method can do follows from what it is, never from its name:
- `parts`: its round is given as a message and a merge (outer/base.RoundParts). The round layer then runs
  it under every codec (config.outer.codec), with streaming overlap (config.outer.overlap) and in the
  asynchronous schedule (config.outer.schedule='async');
- `grouped`: its rounds average within the random groups of config.outer.rule.group_size (checked to divide
  num_replicas; outer/pairing.py draws them); `schedule` draws who exchanges with whom each round;
- `rounds`: whether it has outer rounds at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Unstable:
  """Why a configuration's cross-replica spread is mean-square unstable (a spec's `stability`)."""
  field: str  # the field the refusal names, e.g. "outer.rule.consensus_weight"
  value: Any
  why: str  # one line: what grows, and by how much
  remedy: str  # what to change, e.g. "Lower γ or α"


@dataclasses.dataclass(frozen=True)
class Spec:
  kind: str  # the name config.outer.kind selects it by
  # (config.outer, inner optimizer without clipping or None) -> outer/base.OuterMethod. It imports the JAX
  # parts of the rule when it is called (the spec itself is read without JAX).
  build: Callable
  # (bytes of the one message build's method sends, num_replicas, config.outer) -> (outer/wire.Traffic of one
  # round, of one inner step), per replica, on the wire and as the collectives' operands.
  wire: Callable
  # The hyperparameters in force, in the order the summary names them: `inner_steps` and fields of
  # config.outer.rule. Fields it does not read are ignored by it.
  reads: tuple[str, ...] = ()
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # its values for `reads` left unset
  in_paper: bool = False  # `defaults` are the NoLoCo paper's (the paper runs this method)
  not_in_paper: str = ""  # else: how they were chosen (the log and the summary say so)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # values it sets itself, whatever the fields say
  # The other fields its round reads, among: message_dtype (config.outer.codec), topology, allreduce_algorithm.
  exchange: tuple[str, ...] = ()
  rounds: bool = True
  grouped: bool = False
  parts: bool = False
  # (config.outer, seed, num_replicas) -> who exchanges with whom each round (outer/pairing.PairingSchedule's
  # interface: plan, groups, record); None: a round needs no schedule (an all-reduce).
  schedule: Callable | None = None
  # (config.outer, num_replicas) -> None: the checks only the method knows; raises config's one-line
  # ConfigError (config/fields.fail). Run by the config's cross-section checks.
  check: Callable | None = None
  # (config.outer, num_replicas) -> None (stable) or Unstable: the mean-square stability of the replicas'
  # spread (docs/stability.md). None: not analysed; the log says so and nothing is refused.
  stability: Callable | None = None
  # config.outer -> extra cells of the method's line in the end-of-run summary (training/summary.py).
  cells: Callable = lambda outer: ()

  @property
  def module(self) -> str:
    """The file that defines the method (named by the log that says where its defaults came from)."""
    return getattr(self.build, "func", self.build).__module__.replace(".", "/") + ".py"


def identical_replicas(outer, num_replicas: int) -> None:
  """The stability of a method whose every step or round is an all-reduce: the replicas stay identical,
  there is no spread to grow."""
  del outer, num_replicas
