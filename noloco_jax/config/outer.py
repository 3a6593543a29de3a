"""`config.outer`: the outer step, every H inner steps (noloco_jax/outer/).

The update rule of NoLoCo (docs/method.md), for replica i in a random group G of n replicas, with fast
weights θ, slow weights φ and outer momentum δ:

    δ_i ← α·δ_i + β·mean_G(θ − φ) + γ·(mean_G φ − φ_i);   φ_i ← φ_i + δ_i;   θ_i ← φ_i

α = `outer_momentum`, β = `outer_lr`, γ = `consensus_weight`. DiLoCo uses α and β (outer SGD with
momentum on the all-reduced pseudo-gradient); gossip fixes α=0, β=γ=1; epidemic averages θ with
the models it receives when every replica sends to `fanout` random others (Epidemic Learning, on the
graph `topology`: EL-Oracle's s-regular graph or EL-Local's s-out graph); epidemic_adam is the NoLoCo reference
code's Epidemic Learning variant (group mean, then a second inner-optimizer step along θ − mean_G θ);
ddp and none have no outer step.
Before these names the fields were `momentum`, `lr` and `gamma`: those still work (RENAMED), with a warning.
"""

import dataclasses

from noloco_jax.config.fields import Section, at_least, fail, one_of

# The kinds of outer/methods.py's registry. The schema sits below the methods in the import graph, so a
# method registered at run time (outer.methods.register) adds its kind here through `register_kind`.
KINDS: list[str] = ["noloco", "diloco", "gossip", "epidemic", "epidemic_adam", "ddp", "none"]
MESSAGE_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("", "float32", "bfloat16")
PAIRINGS = ("fresh", "round_robin", "fixed")
GROUP_KINDS = ("noloco", "gossip")  # the NoLoCo-update kinds: compressed messages exist for these
# The kinds that average within random groups of group_size (outer/pairing.py draws the groups).
GROUPED_KINDS: list[str] = [*GROUP_KINDS, "epidemic_adam"]
# Compressed messages (noloco_jax/outer/compression.py, docs/compression.md).
COMPRESSIONS = ("none", "int8", "int4", "topk")
TOPK_BITS = (2, 3, 4, 5, 6, 7, 8)  # bits per kept top-k value (packed); int8 / int4 imply 8 / 4
SLOW_CODECS = ("float32", "bfloat16", "int8", "int4")  # how the γ·φ part of a top-k message travels
MAX_CHUNK = 65536  # top-k offsets within a chunk travel as uint16
# Epidemic Learning's graphs (noloco_jax/outer/epidemic.py): de Vos et al. 2023's two variants.
TOPOLOGIES = ("oracle", "local")
# EL-Oracle's graph is drawn exactly (configuration model, rejection) for min(s, N − 1 − s) ≤ this; the
# acceptance rate falls like exp(−s − (s−1)²/2): ≥ 0.3 % at 3 (12 ms a graph at N = 256), ~0.01 % at 4.
ORACLE_MAX_DEGREE = 3


def register_kind(kind: str, *, grouped: bool = False) -> None:
  """Makes `kind` a valid config.outer.kind (called by noloco_jax.outer.methods.register); `grouped`: its
  rounds average within random groups of group_size, which is then checked like NoLoCo's."""
  if kind not in KINDS:
    KINDS.append(kind)
  if grouped and kind not in GROUPED_KINDS:
    GROUPED_KINDS.append(kind)


@dataclasses.dataclass(frozen=True)
class OuterConfig(Section):
  PATH = "outer"
  RENAMED = {"momentum": "outer_momentum", "lr": "outer_lr", "gamma": "consensus_weight"}

  kind: str = "noloco"  # noloco | diloco | gossip | epidemic | epidemic_adam | ddp | none
  inner_steps: int = 50  # H: inner steps per outer round.
  group_size: int = 2  # n: replicas per averaging group (noloco, gossip, epidemic_adam).
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
  # How the groups are drawn each round (noloco_jax/outer/pairing.py):
  #   fresh       = a new uniformly random grouping every round (the method); on a mesh the next round's
  #                 program is compiled while the current round's inner steps run (outer/ahead.py);
  #   round_robin = one of the N-1 round-robin matchings (relabelled once), uniform per round; one program;
  #                 every pair meets equally often, but only N-1 matchings occur (group_size 2 only);
  #   fixed       = the same grouping every round (ablation).
  pairing: str = "fresh"
  # Validation refuses an (α, γ) whose cross-replica spread is mean-square unstable for this update
  # (docs/stability.md, checked in config/checks.py); True runs it anyway, with a warning.
  allow_unstable: bool = False
  # Compressed messages (noloco, gossip; docs/compression.md): none | int8 | int4 | topk. int8 / int4
  # quantise the whole message per chunk; topk sends, per chunk, the largest topk_density of the fresh
  # part β·(θ − φ) (topk_bits-bit values, uint16 offsets) and the γ·φ part with slow_codec.
  compression: str = "none"
  compression_chunk: int = 4096  # values per chunk (one float32 scale each); at most 65536
  topk_density: float = 0.01  # fraction of each chunk kept, in (0, 1]
  topk_bits: int = 2  # bits per kept value, 2..8
  slow_codec: str = "int8"  # float32 | bfloat16 | int8 | int4: the γ·φ part of a topk message
  # Error feedback: what a compressed message did not carry, times this decay, is added to the next
  # round's message (to whichever partner that goes). 0 = no feedback (and no residual in the state).
  feedback_decay: float = 1.0
  fanout: int = 1  # epidemic: s, the random peers each replica sends its model to per round (< num_replicas)
  # epidemic: the round's random directed graph (de Vos et al. 2023; outer/epidemic.py):
  #   oracle = EL-Oracle: uniform over the s-regular graphs, every replica sends to s and receives from
  #            exactly s others (drawn exactly for min(s, num_replicas − 1 − s) ≤ 3);
  #   local  = EL-Local: every replica sends to s others of its own uniform choice; the in-degree is
  #            random, Binomial(N − 1, s/(N − 1)) (a replica may receive nothing).
  topology: str = "oracle"
  # Streaming overlap (noloco, gossip, any compression; docs/method.md §13): τ inner steps run
  # while a round's exchange is in flight; its group mean is merged after step tH + τ. 0 = wait for it.
  overlap_steps: int = 0  # τ, in [0, inner_steps)
  # λ of the delayed merge θ ← λ·θ_local + (1 − λ)·φ_new (Streaming DiLoCo's mixing factor; 0.5 there):
  # the share of the τ in-flight steps' progress a replica keeps. 0 discards it; 1 never pulls θ to φ.
  overlap_mix: float = 0.5

  def check(self) -> None:
    one_of("outer.kind", self.kind, KINDS)
    at_least("outer.inner_steps", self.inner_steps, 1)
    one_of("outer.message_dtype", self.message_dtype, MESSAGE_DTYPES)
    one_of("outer.state_dtype", self.state_dtype, STATE_DTYPES)
    one_of("outer.pairing", self.pairing, PAIRINGS)
    if self.pairing == "round_robin" and self.kind in GROUPED_KINDS and self.group_size != 2:
      fail("outer.pairing", self.pairing, f"'fresh' or 'fixed' with group_size={self.group_size} ('round_robin' "
           "pairs replicas: group_size 2 only)")
    if not 0 <= self.outer_momentum < 1:
      fail("outer.outer_momentum", self.outer_momentum, "a number in [0, 1)")
    if not self.outer_lr > 0:
      fail("outer.outer_lr", self.outer_lr, "a number > 0")
    if self.kind in GROUPED_KINDS and self.group_size < 2:
      fail("outer.group_size", self.group_size, "an integer ≥ 2 (a group averages at least two replicas)")
    one_of("outer.compression", self.compression, COMPRESSIONS)
    if self.compression != "none" and self.kind not in GROUP_KINDS:
      fail("outer.compression", self.compression,
           f"'none' with outer.kind={self.kind!r} (compressed messages exist for noloco and gossip)")
    if not 8 <= self.compression_chunk <= MAX_CHUNK:
      fail("outer.compression_chunk", self.compression_chunk, f"an integer in [8, {MAX_CHUNK}] (offsets travel as uint16)")
    if not 0 < self.topk_density <= 1:
      fail("outer.topk_density", self.topk_density, "a number in (0, 1]")
    one_of("outer.topk_bits", self.topk_bits, TOPK_BITS)
    one_of("outer.slow_codec", self.slow_codec, SLOW_CODECS)
    if not 0 <= self.feedback_decay <= 1:
      fail("outer.feedback_decay", self.feedback_decay, "a number in [0, 1] (0 turns error feedback off)")
    one_of("outer.topology", self.topology, TOPOLOGIES)
    if self.kind == "epidemic":
      at_least("outer.fanout", self.fanout, 1)
      one_of("outer.pairing", self.pairing, ("fresh", "fixed"))  # a graph per round, not a matching
    elif self.topology != "oracle":
      fail("outer.topology", self.topology, f"'oracle' (the default) with outer.kind={self.kind!r} (a topology "
           "is Epidemic Learning's: outer.kind='epidemic')")
    self._check_overlap()
    if self.kind == "noloco":
      if not self.consensus_weight > 0:
        fail("outer.consensus_weight", self.consensus_weight, "a number > 0")
      # The stability of (α, γ) depends on num_replicas too: checked across sections (config/checks.py).

  def _check_overlap(self) -> None:
    if not 0 <= self.overlap_steps < self.inner_steps:
      fail("outer.overlap_steps", self.overlap_steps,
           f"an integer in [0, outer.inner_steps − 1] = [0, {self.inner_steps - 1}] (the exchange of one round "
           "is merged before the next round's is sent)")
    if not 0 <= self.overlap_mix <= 1:
      fail("outer.overlap_mix", self.overlap_mix, "a number in [0, 1]")
    if self.overlap_steps and self.kind not in GROUP_KINDS:
      fail("outer.overlap_steps", self.overlap_steps,
           f"0 with outer.kind={self.kind!r} (the overlapped exchange exists for noloco and gossip)")
