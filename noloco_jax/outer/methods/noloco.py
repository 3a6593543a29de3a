"""NoLoCo (Kolehmainen et al., 2025), and gossip, its momentum ablation: every H inner steps each replica
averages with the other members of a random group of n (a new grouping every round), through one message.

For replica i in group G, with fast weights θ, slow weights φ and outer momentum δ (docs/method.md §1):

    δ_i ← α·δ_i + β·mean_G(θ − φ) + γ·(mean_G φ − φ_i);   φ_i ← φ_i + δ_i;   θ_i ← φ_i

with the corrected sign (+β, as the paper's appendix Eq. 32 and the reference code; Eq. 2 prints −β) and
heavy-ball momentum (δ is added to φ as it is). The group terms need one tensor per member,
c = β·θ + (γ − β)·φ (outer/exchange.py: `message`), since β·mean_G(θ − φ) + γ·mean_G φ = mean_G(c): the update
is `update` below with m = mean_G(c), one message per partner per round (no all-reduce anywhere).

Gossip is the same rule with α = 0, β = γ = 1: φ ← mean_G θ, plain pairwise averaging.

The round is given in parts (message, merge; outer/base.group_rule), so NoLoCo and gossip run with every
codec, with streaming overlap and in the asynchronous schedule. Stability: the exact mean-square analysis
of this update (outer/stability.py, docs/stability.md) refuses an unstable (α, γ, n, N).
"""

from __future__ import annotations

import functools

from noloco_jax.config.fields import fail
from noloco_jax.outer import pairing, stability, wire
from noloco_jax.outer.methods.base import Spec, Unstable


def update(phi, delta, mean, *, alpha: float, gamma: float):
  """Given m = mean_G(c), one parameter leaf of φ and δ (float32): returns the new (φ, δ)."""
  delta = alpha * delta + mean - gamma * phi
  return phi + delta, delta


def build(outer, optimizer=None, *, alpha=None, beta=None, gamma=None):
  """The method of `outer` (NoLoCo, or gossip at its fixed values)."""
  from noloco_jax.outer import base  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  del optimizer
  r = outer.rule
  alpha, beta, gamma = (r.outer_momentum if alpha is None else alpha, r.outer_lr if beta is None else beta,
                        r.consensus_weight if gamma is None else gamma)
  return base.group_rule(outer.kind, beta=beta, gamma=gamma, update=functools.partial(update, alpha=alpha, gamma=gamma),
                         codec=base.make_codec(outer.codec, inner_steps=outer.inner_steps, beta=beta),
                         # lock-step overlap holds the mean in flight in the state (the asynchronous schedule
                         # merges it from the round driver)
                         inflight=outer.overlap.steps > 0 and outer.schedule == "lockstep")


def schedule(outer, seed: int, num_replicas: int) -> pairing.PairingSchedule:
  return pairing.PairingSchedule(seed=seed, num_replicas=num_replicas, group_size=outer.rule.group_size,
                                 mode=outer.pairing)


def permute_wire(message_bytes: int, num_replicas: int, outer):
  """n − 1 messages sent (and received) per replica per round, by point-to-point sends."""
  del num_replicas
  return wire.permute(message_bytes, outer.rule.group_size - 1), wire.NOTHING


def check(outer, num_replicas: int) -> None:
  del num_replicas
  if not outer.rule.consensus_weight > 0:
    fail("outer.rule.consensus_weight", outer.rule.consensus_weight, "a number > 0")


def analysed(outer, num_replicas: int, alpha=None, gamma=None) -> Unstable | None:
  """The exact mean-square stability of the spread under this update (outer/stability.py)."""
  r = outer.rule
  # Fewer replicas than a group (one: a process of an asynchronous job holds one): nothing is averaged, so
  # there is no spread to analyse (a = (N − n)/(n(N − 1)) has no meaning). Only the asynchronous schedule gets
  # here (lock-step needs n | N): its job size is checked at start-up against its processes
  # (asynchronous/job.check_layout), in one line.
  if num_replicas < max(2, r.group_size):
    return None
  alpha, gamma = r.outer_momentum if alpha is None else alpha, r.consensus_weight if gamma is None else gamma
  problem = stability.instability(alpha, gamma, r.group_size, num_replicas)
  return None if problem is None else Unstable("outer.rule.consensus_weight", gamma, problem, "Lower γ or α")


NOLOCO = Spec(
    kind="noloco", build=build, wire=permute_wire,
    reads=("outer_momentum", "outer_lr", "consensus_weight", "group_size", "inner_steps"),
    defaults=dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, group_size=2, inner_steps=50), in_paper=True,
    exchange=("message_dtype",), grouped=True, parts=True, schedule=schedule, check=check, stability=analysed)

_GOSSIP = dict(outer_momentum=0.0, outer_lr=1.0, consensus_weight=1.0)  # α = 0, β = γ = 1
GOSSIP = Spec(
    kind="gossip", build=functools.partial(build, alpha=0.0, beta=1.0, gamma=1.0), wire=permute_wire,
    reads=("group_size", "inner_steps"), defaults=dict(group_size=2, inner_steps=50),
    not_in_paper="NoLoCo's H and group size", fixed=_GOSSIP, exchange=("message_dtype",), grouped=True, parts=True,
    schedule=schedule, stability=functools.partial(analysed, alpha=0.0, gamma=1.0))
