"""`config.outer`: the outer step, every H inner steps (noloco_jax/outer/).

The update rule of NoLoCo (docs/method.md), for replica i in a random group G of n replicas, with fast
weights θ, slow weights φ and outer momentum δ:

    δ_i ← α·δ_i + β·mean_G(θ − φ) + γ·(mean_G φ − φ_i);   φ_i ← φ_i + δ_i;   θ_i ← φ_i

α = `outer_momentum`, β = `outer_lr`, γ = `consensus_weight`. DiLoCo uses α and β (outer SGD with
momentum on the all-reduced pseudo-gradient); gossip fixes α=0, β=γ=1; ddp and none have no outer step.
Before these names the fields were `momentum`, `lr` and `gamma`: those still work (RENAMED), with a warning.
"""

import dataclasses
import functools
import logging
import math

from noloco_jax.config.fields import Section, at_least, fail, one_of

KINDS = ("noloco", "diloco", "gossip", "ddp", "none")
MESSAGE_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("", "float32", "bfloat16")
PAIRINGS = ("pool", "fresh", "fixed")
GROUP_KINDS = ("noloco", "gossip")  # the kinds that average within random groups of group_size


@dataclasses.dataclass(frozen=True)
class OuterConfig(Section):
  PATH = "outer"
  RENAMED = {"momentum": "outer_momentum", "lr": "outer_lr", "gamma": "consensus_weight"}

  kind: str = "noloco"  # noloco | diloco | gossip | ddp | none
  inner_steps: int = 50  # H: inner steps per outer round.
  group_size: int = 2  # n: replicas per averaging group (noloco, gossip).
  # α: momentum of the outer step, δ ← α·δ + ... (noloco, diloco; NoLoCo reference 0.5, DiLoCo 0.3).
  outer_momentum: float = 0.5
  outer_lr: float = 0.7  # β: outer learning rate, the step along the group's mean θ − φ (noloco, diloco).
  # γ: pull of each replica's slow weights φ_i towards its group's mean φ (noloco only). The paper
  # gives no value; the reference code uses γ = β.
  consensus_weight: float = 0.7
  nesterov: bool = False  # DiLoCo only: Nesterov (original DiLoCo) instead of heavy-ball (reference).
  message_dtype: str = "float32"  # float32 | bfloat16: dtype of the exchanged tensor.
  # Storage dtype of the outer state (φ, δ; DiLoCo's φ and momentum): "" = the parameters' dtype,
  # or float32 | bfloat16. The update itself always computes in float32.
  state_dtype: str = ""
  # Keep φ and δ in pinned host memory between rounds (they are read once per round): the device then
  # holds three model-sized copies (θ, Adam m, v) instead of five. Costs two host<->device copies per round.
  offload: bool = False
  # How a fresh random pairing is chosen every round with a static ppermute:
  #   pool  = `pairing_pool` pairings drawn up front, one picked per round by a traced index (one compile);
  #   fresh = a new pairing drawn on the host every round, compiled on first use and cached.
  #   fixed = the same pairing every round (ablation).
  pairing: str = "pool"
  pairing_pool: int = 32

  def check(self) -> None:
    one_of("outer.kind", self.kind, KINDS)
    at_least("outer.inner_steps", self.inner_steps, 1)
    one_of("outer.message_dtype", self.message_dtype, MESSAGE_DTYPES)
    one_of("outer.state_dtype", self.state_dtype, STATE_DTYPES)
    one_of("outer.pairing", self.pairing, PAIRINGS)
    at_least("outer.pairing_pool", self.pairing_pool, 1)
    if not 0 <= self.outer_momentum < 1:
      fail("outer.outer_momentum", self.outer_momentum, "a number in [0, 1)")
    if not self.outer_lr > 0:
      fail("outer.outer_lr", self.outer_lr, "a number > 0")
    if self.kind in GROUP_KINDS and self.group_size < 2:
      fail("outer.group_size", self.group_size, "an integer ≥ 2 (a group averages at least two replicas)")
    if self.kind == "noloco":
      if not self.consensus_weight > 0:
        fail("outer.consensus_weight", self.consensus_weight, "a number > 0")
      warn_if_unstable(self.outer_momentum, self.consensus_weight, self.group_size)


def stability_interval(alpha: float, n: int) -> tuple[float, float]:
  """The paper's bound on γ for bounded cross-replica variance: √(n/(2(n−1)))·α < γ < √(n(2+α²)/(2(n−1)))."""
  return math.sqrt(n / (2 * (n - 1))) * alpha, math.sqrt(n * (2 + alpha ** 2) / (2 * (n - 1)))


@functools.cache  # once per process and setting: main.py and train.build both validate the config
def warn_if_unstable(alpha: float, gamma: float, n: int) -> None:
  """A warning (not an error: the bound is from a model problem) when γ lies outside stability_interval."""
  low, high = stability_interval(alpha, n)
  if not low < gamma < high:
    logging.warning(
        "outer.consensus_weight=%g (gamma) lies outside the stability bound of the NoLoCo paper (noisy "
        "quadratic model): sqrt(n/(2(n-1)))*alpha < gamma < sqrt(n(2+alpha^2)/(2(n-1))), i.e. %.3f < gamma "
        "< %.3f for n=%d, alpha=outer_momentum=%g. The spread of weights across replicas may grow without "
        "bound.", gamma, low, high, n, alpha)
