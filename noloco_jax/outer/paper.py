"""The NoLoCo paper's outer hyperparameters per method: the one place configs/paper.py,
experiments/lib/experiment.py (the notebooks' sweeps) and the config schema's per-kind defaults take
them from. The table itself is declared in noloco_jax/config/outer.py (the config package imports
nothing else from noloco_jax); this module publishes it.

NoLoCo: α (`outer_momentum`) = 0.5, β (`outer_lr`) = γ (`consensus_weight`) = 0.7, groups of n = 2, H = 50 inner steps.
DiLoCo: α = 0.3, β = 0.7, H = 100, heavy-ball momentum (the reference code's, not Nesterov).
Gossip is NoLoCo with α = 0, β = γ = 1 (set by outer/methods.py), so only n and H are given.
The paper does not run the Epidemic Learning kinds: they get NoLoCo's H and pairs (epidemic_adam, the
reference code's variant, groups as NoLoCo does) or one peer (epidemic), so that a sweep compares them
with NoLoCo at the same bytes per round.

`--config.outer.kind=KIND` alone trains KIND at these values: an unset field takes them when the
config is validated (config/outer.py).
"""

from __future__ import annotations

from typing import Any

from noloco_jax.config.outer import PAPER_OUTER

__all__ = ["PAPER_OUTER", "paper_outer"]


def paper_outer(kind: str) -> dict[str, Any]:
  """`config.outer` fields of method `kind` as the paper runs it, `kind` included."""
  return dict(kind=kind, **PAPER_OUTER[kind])
