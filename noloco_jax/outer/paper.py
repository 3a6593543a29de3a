"""The NoLoCo paper's outer hyperparameters per method: the one place configs/paper.py and
experiments/lib/experiment.py (the notebooks' sweeps) take them from. Standard library only: config files
import it while flags are parsed.

NoLoCo: α (`outer_momentum`) = 0.5, β (`outer_lr`) = γ (`consensus_weight`) = 0.7, groups of n = 2, H = 50 inner steps.
DiLoCo: α = 0.3, β = 0.7, H = 100, heavy-ball momentum (the reference code's, not Nesterov).
Gossip is NoLoCo with α = 0, β = γ = 1 (set by outer/methods.py), so only n and H are given.
The paper does not run the Epidemic Learning kinds: they get NoLoCo's H and pairs (epidemic_adam, the
reference code's variant, groups as NoLoCo does) or one peer (epidemic), so that a sweep compares them
with NoLoCo at the same bytes per round.
"""

from __future__ import annotations

from typing import Any

PAPER_OUTER: dict[str, dict[str, Any]] = {
    "noloco": dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, group_size=2, inner_steps=50),
    "diloco": dict(outer_momentum=0.3, outer_lr=0.7, nesterov=False, inner_steps=100),
    "gossip": dict(group_size=2, inner_steps=50),
    "epidemic": dict(fanout=1, inner_steps=50),  # not in the paper: NoLoCo's H, one model sent per round
    "epidemic_adam": dict(group_size=2, inner_steps=50),  # not in the paper: NoLoCo's H and pairs
    "ddp": {},
    "none": {},
}


def paper_outer(kind: str) -> dict[str, Any]:
  """`config.outer` fields of method `kind` as the paper runs it, `kind` included."""
  return dict(kind=kind, **PAPER_OUTER[kind])
