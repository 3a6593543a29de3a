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

Each kind at its own paper defaults. The fields whose value depends on the method (`PER_KIND`: H, n,
α, β, γ, nesterov, s) default to *unset* (None). Validation resolves an unset field from the paper's
values for the chosen kind (`PAPER_OUTER`, which noloco_jax/outer/paper.py publishes), or, for a field
the kind does not use, from `UNSET_DEFAULTS` (the values these fields had before: NoLoCo's). So
`--config.outer.kind=diloco` trains with DiLoCo's α = 0.3, β = 0.7, H = 100, while a value given on the
command line or in a config file, even one equal to NoLoCo's, is kept; the log names the values that
came from the paper. A config file written with every field set keeps its values, as before.
"""

import dataclasses
import logging
from typing import Any

from noloco_jax.config.fields import Section, at_least, fail, one_of

# The kinds of outer/methods.py's registry. The schema sits below the methods in the import graph, so a
# method registered at run time (outer.methods.register) adds its kind here through `register_kind`.
KINDS: list[str] = ["noloco", "diloco", "gossip", "epidemic", "epidemic_adam", "ddp", "none"]
MESSAGE_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("", "float32", "bfloat16")
PAIRINGS = ("fresh", "round_robin", "fixed")
# How rounds are scheduled (noloco_jax/training/rounds/): every replica in lock-step, or each process at
# its own pace, paired at run time with whoever is ready (docs/async.md).
SCHEDULES = ("lockstep", "async")
ASYNC_KINDS = ("noloco", "gossip")  # the kinds the asynchronous schedule runs
MATCH_ODD = ("triple", "leave_out")  # an odd batch of ready processes (noloco_jax/asynchronous/law.py)
GROUP_KINDS = ("noloco", "gossip")  # the NoLoCo-update kinds: compressed messages exist for these
# The kinds that average within random groups of group_size (outer/pairing.py draws the groups).
GROUPED_KINDS: list[str] = [*GROUP_KINDS, "epidemic_adam"]
# Compressed messages (noloco_jax/outer/compression.py, docs/compression.md).
COMPRESSIONS = ("none", "int8", "int4", "topk", "coset")
COSET_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)  # coset codes of 2..8 bits; 16 / 32: the fragment's values as they are
COSET_ORDERS = ("cyclic", "random", "fixed", "fisher", "mixed", "damage")  # how a coset message's fragment is chosen each round (outer/coset.py)
COSET_MODES = ("fragment", "sum", "global")  # which values a coset message codes (outer/coset.py)
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

# How an all-reduce is priced on the wire (noloco_jax/outer/wire.py: ALLREDUCE_ALGORITHMS).
ALLREDUCE_ALGORITHMS = ("ring", "tree")

# The NoLoCo paper's outer hyperparameters per method (arXiv 2506.10911; docs/method.md §10), published
# as noloco_jax/outer/paper.py. NoLoCo: α = 0.5, β = γ = 0.7, n = 2, H = 50. DiLoCo: α = 0.3, β = 0.7,
# H = 100, heavy-ball (the reference code's, not Nesterov). Gossip is NoLoCo with α = 0, β = γ = 1 (set by
# outer/methods.py), so only n and H are given. The paper does not run the Epidemic Learning kinds: they
# get NoLoCo's H and pairs (epidemic_adam) or one peer (epidemic), the same bytes per round as NoLoCo.
PAPER_OUTER: dict[str, dict[str, Any]] = {
    "noloco": dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, group_size=2, inner_steps=50),
    "diloco": dict(outer_momentum=0.3, outer_lr=0.7, nesterov=False, inner_steps=100),
    "gossip": dict(group_size=2, inner_steps=50),
    "epidemic": dict(fanout=1, inner_steps=50),
    "epidemic_adam": dict(group_size=2, inner_steps=50),
    "ddp": {},
    "none": {},
}
# The kinds the NoLoCo paper runs: only their values above are the paper's. The others' are this project's
# choice (NoLoCo's H and pairs or one peer), and the log and the summary say so rather than "paper".
PAPER_KINDS = ("noloco", "diloco")
# The fields a kind's paper defaults fill when left unset, and what a field the kind does not use gets.
UNSET_DEFAULTS: dict[str, Any] = dict(inner_steps=50, group_size=2, outer_momentum=0.5, outer_lr=0.7,
                                      consensus_weight=0.7, nesterov=False, fanout=1)
PER_KIND = tuple(UNSET_DEFAULTS)
# The hyperparameters each kind uses (the others are ignored by it): what the end-of-run summary names.
IN_FORCE: dict[str, tuple[str, ...]] = {
    "noloco": ("outer_momentum", "outer_lr", "consensus_weight", "group_size", "inner_steps"),
    "gossip": ("group_size", "inner_steps"),
    "epidemic": ("fanout", "inner_steps"),
    "epidemic_adam": ("group_size", "inner_steps"),
    "diloco": ("outer_momentum", "outer_lr", "nesterov", "inner_steps"),
    "ddp": (),
    "none": (),
}
# Values a kind fixes itself, whatever the fields say (outer/methods.py).
FIXED_BY_KIND: dict[str, dict[str, float]] = {"gossip": dict(outer_momentum=0.0, outer_lr=1.0, consensus_weight=1.0)}
_logged: set[str] = set()  # the resolution is logged once per process and message


@dataclasses.dataclass(frozen=True)
class OuterConfig(Section):
  PATH = "outer"
  RENAMED = {"momentum": "outer_momentum", "lr": "outer_lr", "gamma": "consensus_weight"}
  UNSET = UNSET_DEFAULTS  # what "at its default" meant before the per-kind fields could be unset

  kind: str = "noloco"  # noloco | diloco | gossip | epidemic | epidemic_adam | ddp | none
  # The next seven fields left unset (None) take the kind's paper value (PAPER_OUTER above; the
  # module docstring), e.g. H = 50 for noloco and 100 for diloco.
  inner_steps: int | None = None  # H: inner steps per outer round.
  group_size: int | None = None  # n: replicas per averaging group (noloco, gossip, epidemic_adam).
  # α: momentum of the outer step, δ ← α·δ + ... (noloco, diloco; NoLoCo paper 0.5, DiLoCo 0.3).
  outer_momentum: float | None = None
  outer_lr: float | None = None  # β: outer learning rate, the step along the group's mean θ − φ (noloco, diloco; 0.7).
  # γ: pull of each replica's slow weights φ_i towards its group's mean φ (noloco only). The paper
  # gives no value; the reference code uses γ = β (0.7).
  consensus_weight: float | None = None
  nesterov: bool | None = None  # DiLoCo only: Nesterov (original DiLoCo) instead of heavy-ball (paper: False).
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
  # compression='coset' (outer/coset.py): the whole message, a shared fragment of coset_density of each
  # leaf's blocks of coset_block values, in coset_bits-bit codes decoded against the receiver's own message.
  coset_density: float = 0.25  # fraction of each leaf's blocks sent per round, in (0, 1]
  coset_bits: int = 2  # bits per value: 2..8 (coset codes), 16 / 32 (bfloat16 / float32 values)
  coset_block: int = 256  # values per block of the fragment
  # cyclic (every block once per ceil(1/density) rounds) | random (a new subset per round) | fixed (the same random
  # blocks every round) | fisher (the sender's
  # blocks of largest Adam second moment; indices sent) | mixed (half fisher, half cyclic) | damage (largest
  # second moment × (rounds since the block was last averaged + 1))
  coset_order: str = "cyclic"
  coset_kappa: float = 0.0  # lattice step / the estimated rms of the partners' difference; 0 = the default for coset_bits
  # fragment: a fragment of coset_density of the blocks, the rest not sent | sum: every group of 1/coset_density
  # values as one signed sum (1/coset_density a power of two) | global: one fragment of coset_density of the
  # whole message's blocks, those of largest expected damage (the sender's Adam second moment × its spread estimate)
  coset_mode: str = "fragment"
  # leaf: one lattice step per leaf | block: one per block (coset_mode='fragment'), from a running estimate per block
  coset_scale: str = "leaf"
  fanout: int | None = None  # epidemic: s, the random peers each replica sends its model to per round (< num_replicas; 1)
  # epidemic: the round's random directed graph (de Vos et al. 2023; outer/epidemic.py):
  #   oracle = EL-Oracle: uniform over the s-regular graphs, every replica sends to s and receives from
  #            exactly s others (drawn exactly for min(s, num_replicas − 1 − s) ≤ 3);
  #   local  = EL-Local: every replica sends to s others of its own uniform choice; the in-degree is
  #            random, Binomial(N − 1, s/(N − 1)) (a replica may receive nothing).
  topology: str = "oracle"
  # How the wire figures price an all-reduce (DiLoCo's round, DDP's step; noloco_jax/outer/wire.py):
  # ring | tree. Accounting only: XLA and NCCL choose their own algorithm, this names the one assumed
  # by comm/bytes_sent_per_replica and comm/bytes_received_per_replica.
  allreduce_algorithm: str = "ring"
  # Streaming overlap (noloco, gossip, any compression; docs/method.md §13): τ inner steps run
  # while a round's exchange is in flight; its group mean is merged after step tH + τ. 0 = wait for it.
  # With outer.schedule='async': up to τ inner steps run while the round finds its partner and exchanges;
  # it is merged after the first step by which it is done (docs/async.md §3).
  overlap_steps: int = 0  # τ, in [0, inner_steps)
  # λ of the delayed merge θ ← λ·θ_local + (1 − λ)·φ_new (Streaming DiLoCo's mixing factor; 0.5 there):
  # the share of the τ in-flight steps' progress a replica keeps. 0 discards it; 1 never pulls θ to φ.
  overlap_mix: float = 0.5
  # The round schedule (docs/async.md): "lockstep" = every replica runs round r together (a compiled
  # program over the mesh); "async" = one replica per process, each process trains at its own pace and,
  # after its H inner steps, is paired at run time with another process that is ready (noloco, gossip).
  schedule: str = "lockstep"
  # async: seconds a ready process may wait for a partner; none by then: the exchange is skipped
  # (counted: async/skipped_rounds), the replica trains on.
  max_wait_s: float = 5.0
  # async: a batch of ready processes stays open this long for more to arrive before it is grouped
  # (noloco_jax/asynchronous/law.py); 0 pairs the first two that are ready.
  match_window_s: float = 0.05
  # async: λ of the staleness-weighted update (outer/async_rules.py): a member's message counts
  # exp(−λ · lag) with lag its progress behind the group's front-runner, in rounds. 0 = no discount;
  # ln 2 ≈ 0.693 halves a message per round behind.
  staleness_decay: float = 0.693
  # async: an exchange that has not completed after this many seconds fails (counted: async/failed_rounds)
  # and the state stays as it was: the partner died, stalled or gave up.
  exchange_timeout_s: float = 30.0
  # async: a process whose heartbeat (every lease_s / 10 s) has not moved for this long is held dead:
  # never paired again, logged as lost.
  lease_s: float = 10.0
  # async: an odd batch of ready processes: "triple" (one group of three) or "leave_out" (one waits on).
  match_odd: str = "triple"
  # async: how long a (re)started process waits for the live peer it asked for its state (the peer
  # serves it at its next round boundary) before it asks another.
  join_timeout_s: float = 300.0

  def __post_init__(self):
    # Unset per-kind fields take the kind's paper value (module docstring); which ones did is kept
    # for the log and for a config file's ConfigDict (`unset_fields`).
    paper = PAPER_OUTER.get(self.kind, {})
    unset = tuple(name for name in PER_KIND if getattr(self, name) is None)
    for name in unset:
      object.__setattr__(self, name, paper.get(name, UNSET_DEFAULTS[name]))
    object.__setattr__(self, "_unset", unset)

  def unset_fields(self) -> tuple[str, ...]:
    return self._unset

  def from_paper(self) -> dict[str, Any]:
    """{field: value} of the hyperparameters in force that were left unset and took the paper's value."""
    return {name: getattr(self, name) for name in IN_FORCE.get(self.kind, ()) if name in self._unset}

  def in_force(self) -> dict[str, Any]:
    """{field: value} of every outer hyperparameter this kind uses, the values it fixes itself included."""
    return {**FIXED_BY_KIND.get(self.kind, {}), **{name: getattr(self, name) for name in IN_FORCE.get(self.kind, ())}}

  @classmethod
  def parse(cls, node) -> "OuterConfig":
    section = super().parse(node)
    taken = section.from_paper()
    if section is not node and taken:
      source = (f"paper's defaults for {section.kind}" if section.kind in PAPER_KINDS else
                f"defaults for {section.kind}, which the paper does not run (NoLoCo's H and group size)")
      message = (f"config.outer.kind={section.kind!r}: {', '.join(f'{k}={v!r}' for k, v in taken.items())} from the "
                 f"{source} (noloco_jax/outer/paper.py); set a field to override it.")
      if message not in _logged:
        _logged.add(message)
        logging.info("%s", message)
    return section

  def check(self) -> None:
    one_of("outer.kind", self.kind, KINDS)
    one_of("outer.allreduce_algorithm", self.allreduce_algorithm, ALLREDUCE_ALGORITHMS)
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
    self._check_coset()
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
    self._check_schedule()
    if self.kind == "noloco":
      if not self.consensus_weight > 0:
        fail("outer.consensus_weight", self.consensus_weight, "a number > 0")
      # The stability of (α, γ) depends on num_replicas too: checked across sections (config/checks.py).

  def _check_coset(self) -> None:
    if not 0 < self.coset_density <= 1:
      fail("outer.coset_density", self.coset_density, "a number in (0, 1]")
    one_of("outer.coset_bits", self.coset_bits, COSET_BITS)
    at_least("outer.coset_block", self.coset_block, 8)
    one_of("outer.coset_order", self.coset_order, COSET_ORDERS)
    one_of("outer.coset_mode", self.coset_mode, COSET_MODES)
    one_of("outer.coset_scale", self.coset_scale, ("leaf", "block"))
    if self.coset_scale == "block" and self.coset_mode != "fragment":
      fail("outer.coset_scale", self.coset_scale, "'leaf' with coset_mode=" + repr(self.coset_mode) + " ('block' is fragment mode's)")
    g = round(1 / self.coset_density)
    if self.coset_mode == "sum" and (g & (g - 1) or abs(g * self.coset_density - 1) > 1e-9):
      fail("outer.coset_density", self.coset_density, "1/g with g a power of two (1, 0.5, 0.25, ...) with coset_mode='sum'")
    if self.coset_mode == "global" and self.coset_bits > 8:
      fail("outer.coset_bits", self.coset_bits, "2..8 with coset_mode='global' (it sends coset codes only)")
    if not self.coset_kappa >= 0:
      fail("outer.coset_kappa", self.coset_kappa, "a number ≥ 0 (0 = the default for coset_bits)")
    if self.compression == "coset" and self.kind in GROUPED_KINDS and self.group_size != 2:
      fail("outer.group_size", self.group_size, "2 with outer.compression='coset' (its scale estimate reads a pair's mean)")
    if self.compression == "coset" and self.overlap_steps:
      fail("outer.overlap_steps", self.overlap_steps, "0 with outer.compression='coset' (not yet with streaming overlap)")

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

  def _check_schedule(self) -> None:
    one_of("outer.schedule", self.schedule, SCHEDULES)
    if self.schedule != "async":
      return
    with_async = lambda what: f"{what} with outer.schedule='async'"
    if self.kind not in ASYNC_KINDS:
      fail("outer.schedule", self.schedule, f"'lockstep' with outer.kind={self.kind!r} (the asynchronous schedule "
           f"runs {' and '.join(ASYNC_KINDS)}: pairs found at run time, no all-reduce)")
    if self.group_size != 2:
      fail("outer.group_size", self.group_size, with_async("2") + " (ready processes are paired; an odd one "
           "out joins a pair, outer.match_odd)")
    if self.pairing != "fresh":
      fail("outer.pairing", self.pairing, with_async("'fresh'") + " (the partners are found at run time among "
           "the processes that are ready)")
    for name, value, default in (("compression", self.compression, "none"), ("offload", self.offload, False)):
      if value != default:
        fail(f"outer.{name}", value, with_async(repr(default)) + " (not supported by the asynchronous schedule)")
    if not self.max_wait_s > 0:
      fail("outer.max_wait_s", self.max_wait_s, "a number of seconds > 0")
    if not self.match_window_s >= 0:
      fail("outer.match_window_s", self.match_window_s, "a number of seconds ≥ 0")
    if not self.staleness_decay >= 0:
      fail("outer.staleness_decay", self.staleness_decay, "a number ≥ 0 (0 turns the staleness discount off)")
    if not self.exchange_timeout_s > 0:
      fail("outer.exchange_timeout_s", self.exchange_timeout_s, "a number of seconds > 0")
    if not self.lease_s >= 1:
      fail("outer.lease_s", self.lease_s, "a number of seconds ≥ 1 (several heartbeats per lease)")
    one_of("outer.match_odd", self.match_odd, MATCH_ODD)
    if not self.join_timeout_s > 0:
      fail("outer.join_timeout_s", self.join_timeout_s, "a number of seconds > 0")
