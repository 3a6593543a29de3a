"""Epidemic Learning (de Vos et al., 2023, arXiv 2310.01972): every round each replica sends its model to
s = config.outer.rule.fanout other replicas and replaces its model by the plain average of its own and
everything it received:

    θ_i ← (θ_i + Σ_{j → i} θ_j) / (1 + in-degree(i)).

Who sends to whom is the round's random directed graph, config.outer.rule.topology: EL-Oracle's s-regular
graph (every replica receives exactly s models) or EL-Local's (each sender picks its s receivers); how they
are drawn and sent with static collectives: outer/epidemic.py. `outer["slow"]` is θ after the round, so
outer/pseudo_grad_norm is ‖θ − θ_prev round‖. The NoLoCo paper does not run it: it gets NoLoCo's H and one
peer, the same bytes per round as NoLoCo's pairs. Its stability is not analysed.
"""

from __future__ import annotations

from noloco_jax.config.fields import at_least, fail, one_of
from noloco_jax.outer import epidemic, wire
from noloco_jax.outer.methods.base import Spec

GRAPH_NAMES = {"oracle": "EL-Oracle", "local": "EL-Local"}  # as de Vos et al. name them


def build(outer, optimizer=None):
  # pylint: disable=g-import-not-at-top  (JAX: outer/methods/base.py says why)
  import jax
  from noloco_jax.outer import base, exchange
  del optimizer
  dtype = base.MESSAGE_DTYPES[outer.codec.message_dtype]

  def make_round(pool, num_devices):
    (graph,) = pool  # EpidemicSchedule.plan: one static graph per program

    def round_fn(states, route):
      del route  # the graph is static
      theta = states.params
      metrics = {"pseudo_grad_norm": base.pseudo_grad_norm(states)}
      mean = exchange.graph_mean(theta, graph, num_devices, dtype)
      new = jax.tree.map(lambda m, t: m.astype(t.dtype), mean, theta)
      return states.replace(params=new, outer={"slow": new}), metrics
    return round_fn

  return base.OuterMethod(kind=outer.kind, init=lambda params: {"slow": params}, make_round=make_round,
                          new_replica=base.from_slow, message_bytes=lambda params: base.tree_bytes(params, dtype))


def schedule(outer, seed: int, num_replicas: int) -> epidemic.EpidemicSchedule:
  return epidemic.EpidemicSchedule(seed=seed, num_replicas=num_replicas, fanout=outer.rule.fanout, mode=outer.pairing,
                                   topology=outer.rule.topology)


def push_wire(message_bytes: int, num_replicas: int, outer):
  """s models sent per replica; received: s each under EL-Oracle, s on average under EL-Local."""
  return (wire.push(message_bytes, outer.rule.fanout, num_replicas, regular=outer.rule.topology == "oracle"),
          wire.NOTHING)


def check(outer, num_replicas: int) -> None:
  s = outer.rule.fanout
  at_least("outer.rule.fanout", s, 1)
  one_of("outer.pairing", outer.pairing, epidemic.MODES)  # a graph per round, not a matching
  if s >= num_replicas:
    fail("outer.rule.fanout", s, f"an integer in [1, num_replicas − 1] = [1, {num_replicas - 1}] (each replica sends "
         "to that many distinct other replicas)")
  if outer.rule.topology == "oracle" and min(s, num_replicas - 1 - s) > epidemic.ORACLE_MAX_DEGREE:
    valid = [f for f in range(1, num_replicas) if min(f, num_replicas - 1 - f) <= epidemic.ORACLE_MAX_DEGREE]
    fail("outer.rule.fanout", s, f"one of {valid} with outer.rule.topology='oracle' and num_replicas={num_replicas} "
         f"(the exact s-regular draw needs min(s, N − 1 − s) ≤ {epidemic.ORACLE_MAX_DEGREE}), or "
         "outer.rule.topology='local'")


def cells(outer) -> tuple[str, ...]:
  return (f"graph {GRAPH_NAMES[outer.rule.topology]} (topology={outer.rule.topology})",)


EPIDEMIC = Spec(
    kind="epidemic", build=build, wire=push_wire, reads=("fanout", "inner_steps"),
    defaults=dict(fanout=1, inner_steps=50), not_in_paper="NoLoCo's H and one peer",
    exchange=("message_dtype", "topology"), schedule=schedule, check=check, cells=cells)
