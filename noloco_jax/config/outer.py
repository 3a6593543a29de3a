"""`config.outer`: the outer step, every H inner steps (noloco_jax/outer/), in sections.

    outer.kind, outer.inner_steps        the method (noloco_jax/outer/methods/) and H, its round interval
    outer.rule.*                         the method's hyperparameters (α, β, γ, n, s, ...)
    outer.codec.*                        how a message travels: its dtype, a compression codec
    outer.overlap.*                      streaming overlap: inner steps run while an exchange is in flight
    outer.streaming.*                    fragment streaming: the message in F fragments, each at its own offset
    outer.schedule, outer.asynchronous.* lock-step rounds, or each process at its own pace (docs/async.md)
    outer.pairing, .state_dtype, .offload, .allow_unstable

Each method describes itself (its `Spec`, noloco_jax/outer/methods/): which fields it reads, its values
for them, its own checks, what it can do (codecs, overlap, the asynchronous schedule). The schema sits
below the methods in the import graph, so the methods register their specs here (`register`; the package
imports them first): this module names no method.

Each kind at its own defaults: `inner_steps` and the rule's fields that may be unset (`RuleConfig.UNSET`)
default to None. An unset field takes the chosen kind's value (its spec's `defaults`: the paper's for the
methods the paper runs), or, for a field the kind does not read, `UNSET` (NoLoCo's, the values these
fields had before they could be unset). So `--config.outer.kind=diloco` trains DiLoCo with α = 0.3,
β = 0.7, H = 100, while a value set on the command line or in a config file, even one equal to NoLoCo's,
is kept; the log names the values that came from the kind.

Renamed fields keep working with a warning naming the new one (`OuterConfig.RENAMED`): the flat fields
of this section before it was cut into sections (`outer.compression` is `outer.codec.compression`,
`outer.overlap_steps` is `outer.overlap.steps`, ...) and older names (`outer.momentum`, `outer.lr`,
`outer.gamma`).
"""

import dataclasses
import logging
from typing import Any

from noloco_jax.config.fields import Section, at_least, fail, one_of

# The methods' specs by kind, in the order they were registered (noloco_jax/outer/methods/); the first is
# the default kind.
METHODS: dict[str, Any] = {}
MESSAGE_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("", "float32", "bfloat16")
PAIRINGS = ("fresh", "round_robin", "fixed")
# How rounds are scheduled (noloco_jax/training/rounds/): every replica in lock-step, or each process at
# its own pace, paired at run time with whoever is ready (docs/async.md).
SCHEDULES = ("lockstep", "async")
MATCH_ODD = ("triple", "leave_out")  # an odd batch of ready processes (noloco_jax/asynchronous/law.py)
# Compressed messages (noloco_jax/outer/compression.py, docs/compression.md).
COMPRESSIONS = ("none", "int8", "int4", "topk", "coset")
COSET_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)  # coset codes of 2..8 bits; 16 / 32: the fragment's values as they are
COSET_ORDERS = ("cyclic", "random", "fixed", "fisher", "mixed", "damage")  # how a coset fragment is chosen (outer/coset.py)
COSET_MODES = ("fragment", "sum", "global")  # which values a coset message codes (outer/coset.py)
COSET_SCALES = ("leaf", "block")
COSET_RESTS = ("step", "keep", "anchor")  # the rule off a coset fragment (outer/coset.py: off_fragment)
# Fragment streaming (noloco_jax/outer/streaming.py): how the message is cut, and whose partner a fragment has.
STREAM_SPLITS = ("slices", "layers")
STREAM_PARTNERS = ("shared", "own")  # one lattice step per leaf, or per block of a fragment
TOPK_BITS = (2, 3, 4, 5, 6, 7, 8)  # bits per kept top-k value (packed); int8 / int4 imply 8 / 4
SLOW_CODECS = ("float32", "bfloat16", "int8", "int4")  # how the γ·φ part of a top-k message travels
MAX_CHUNK = 65536  # top-k offsets within a chunk travel as uint16
# Epidemic Learning's graphs (noloco_jax/outer/epidemic.py): de Vos et al. 2023's two variants.
TOPOLOGIES = ("oracle", "local")
# How an all-reduce is priced on the wire (noloco_jax/outer/wire.py: ALLREDUCE_ALGORITHMS).
ALLREDUCE_ALGORITHMS = ("ring", "tree")
_logged: set[str] = set()  # the resolution is logged once per process and message


def register(spec) -> None:
  """Makes `spec.kind` a valid config.outer.kind (noloco_jax.outer.methods.register calls this)."""
  METHODS[spec.kind] = spec


def default_kind() -> str:
  return next(iter(METHODS))  # NoLoCo: noloco_jax/outer/methods/ registers it first, when the package is imported


def spec(kind: str):
  """The registered spec of `kind` (one line naming the field when there is none)."""
  one_of("outer.kind", kind, list(METHODS))
  return METHODS[kind]


@dataclasses.dataclass(frozen=True)
class RuleConfig(Section):
  """`config.outer.rule`: the method's hyperparameters. Which ones a kind reads, and its values for those
  left unset, its spec says (noloco_jax/outer/methods/; the end-of-run summary names them)."""
  PATH = "outer.rule"
  # The fields that may be left unset, and what each holds then for a kind that does not read it.
  UNSET = dict(group_size=2, outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, nesterov=False, fanout=1)

  group_size: int | None = None  # n: replicas per averaging group (the kinds that average within groups).
  outer_momentum: float | None = None  # α: momentum of the outer step, δ ← α·δ + ... (NoLoCo paper 0.5, DiLoCo 0.3).
  outer_lr: float | None = None  # β: outer learning rate, the step along the group's mean θ − φ (0.7).
  # γ: pull of each replica's slow weights φ_i towards its group's mean φ. The paper gives no value; the
  # reference code uses γ = β (0.7).
  consensus_weight: float | None = None
  nesterov: bool | None = None  # Nesterov outer momentum instead of heavy-ball (original DiLoCo; paper: False).
  fanout: int | None = None  # s: the random peers each replica sends its model to per round (< num_replicas).
  # The round's random graph of a push to `fanout` peers (outer/epidemic.py): oracle = EL-Oracle (s-regular:
  # every replica receives exactly s; min(s, N − 1 − s) ≤ 3) | local = EL-Local (each sender picks its s).
  topology: str = "oracle"
  # How the wire figures price an all-reduce (outer/wire.py): ring | tree. Accounting only: XLA and NCCL
  # choose their own algorithm; this names the one comm/bytes_sent_per_replica assumes.
  allreduce_algorithm: str = "ring"

  def unset_fields(self) -> tuple[str, ...]:
    return getattr(self, "_unset", ())

  def check(self) -> None:
    one_of("outer.rule.topology", self.topology, TOPOLOGIES)
    one_of("outer.rule.allreduce_algorithm", self.allreduce_algorithm, ALLREDUCE_ALGORITHMS)


@dataclasses.dataclass(frozen=True)
class CodecConfig(Section):
  """`config.outer.codec`: how a round's message travels (noloco_jax/outer/exchange.py). Compressed
  messages exist for the methods whose round is given in parts (docs/compression.md)."""
  PATH = "outer.codec"

  message_dtype: str = "float32"  # float32 | bfloat16: dtype of the exchanged tensor.
  # none | int8 | int4 | topk. int8 / int4 quantise the whole message per chunk; topk sends, per chunk, the
  # largest topk_density of the fresh part β·(θ − φ) (topk_bits-bit values, uint16 offsets) and the γ·φ
  # part with slow_codec.
  compression: str = "none"
  chunk: int = 4096  # values per chunk (one float32 scale each); at most 65536
  topk_density: float = 0.01  # fraction of each chunk kept, in (0, 1]
  topk_bits: int = 2  # bits per kept value, 2..8
  slow_codec: str = "int8"  # float32 | bfloat16 | int8 | int4: the γ·φ part of a topk message
  # Error feedback: what a compressed message did not carry, times this decay, is added to the next
  # round's message (to whichever partner that goes). 0 = no feedback (and no residual in the state).
  feedback_decay: float = 1.0
  # compression='coset' (outer/coset.py; docs/compression.md): NoLoCo's whole message c = β·θ + (γ − β)·φ, a
  # shared fragment of coset_density of each leaf's blocks of coset_block values, in coset_bits-bit codes that
  # the receiver decodes against its own message. Pairs (rule.group_size 2), lock-step, no overlap.
  coset_density: float = 0.25  # fraction of each leaf's blocks sent per round, in (0, 1]
  coset_bits: int = 2  # bits per value: 2..8 (coset codes), 16 / 32 (bfloat16 / float32 values)
  coset_block: int = 256  # values per block of the fragment (≥ 8)
  # cyclic (every block once per ceil(1/density) rounds) | random (a new subset per round) | fixed (the same
  # random blocks every round) | fisher (the sender's blocks of largest Adam second moment; indices sent) |
  # mixed (half fisher, half cyclic) | damage (largest second moment × (rounds since last averaged + 1))
  coset_order: str = "cyclic"
  coset_kappa: float = 0.0  # lattice step / the estimated rms of the partners' difference; 0 = coset_bits' default
  # fragment: coset_density of the blocks, the rest not sent | sum: every group of 1/coset_density values as one
  # signed sum (1/coset_density a power of two) | global: coset_density of the whole message's blocks, those of
  # largest expected damage (the sender's Adam second moment × its spread estimate)
  coset_mode: str = "fragment"
  coset_scale: str = "leaf"  # leaf: one lattice step per leaf | block: one per block (coset_mode='fragment')
  # Off the fragment: step (the round's rule with the partner's value taken as the receiver's own: a local
  # outer step) | keep (no outer step: θ as trained, φ ← θ, δ kept) | anchor (θ, φ, δ kept: the pseudo-gradient
  # grows until the value is next in a fragment). keep / anchor: coset_mode='fragment', a shared coset_order.
  coset_rest: str = "step"
  # The key of the pair's shared randomness (which blocks, the dither), the same on every replica. The
  # run's config.seed does not change it: a sweep over seeds sets it too (experiments/bench_compression.py).
  coset_seed: int = 0

  def check(self) -> None:
    one_of("outer.codec.message_dtype", self.message_dtype, MESSAGE_DTYPES)
    one_of("outer.codec.compression", self.compression, COMPRESSIONS)
    if not 8 <= self.chunk <= MAX_CHUNK:
      fail("outer.codec.chunk", self.chunk, f"an integer in [8, {MAX_CHUNK}] (offsets travel as uint16)")
    if not 0 < self.topk_density <= 1:
      fail("outer.codec.topk_density", self.topk_density, "a number in (0, 1]")
    one_of("outer.codec.topk_bits", self.topk_bits, TOPK_BITS)
    one_of("outer.codec.slow_codec", self.slow_codec, SLOW_CODECS)
    if not 0 <= self.feedback_decay <= 1:
      fail("outer.codec.feedback_decay", self.feedback_decay, "a number in [0, 1] (0 turns error feedback off)")
    self._check_coset()

  def _check_coset(self) -> None:
    if not 0 < self.coset_density <= 1:
      fail("outer.codec.coset_density", self.coset_density, "a number in (0, 1]")
    one_of("outer.codec.coset_bits", self.coset_bits, COSET_BITS)
    at_least("outer.codec.coset_block", self.coset_block, 8)
    one_of("outer.codec.coset_order", self.coset_order, COSET_ORDERS)
    one_of("outer.codec.coset_mode", self.coset_mode, COSET_MODES)
    one_of("outer.codec.coset_scale", self.coset_scale, COSET_SCALES)
    if self.coset_scale == "block" and self.coset_mode != "fragment":
      fail("outer.codec.coset_scale", self.coset_scale, f"'leaf' with coset_mode={self.coset_mode!r} ('block' is "
           "fragment mode's)")
    g = round(1 / self.coset_density)
    if self.coset_mode == "sum" and (g & (g - 1) or abs(g * self.coset_density - 1) > 1e-9):
      fail("outer.codec.coset_density", self.coset_density, "1/g with g a power of two (1, 0.5, 0.25, ...) with "
           "coset_mode='sum'")
    if self.coset_mode == "global" and self.coset_bits > 8:
      fail("outer.codec.coset_bits", self.coset_bits, "2..8 with coset_mode='global' (it sends coset codes only)")
    one_of("outer.codec.coset_rest", self.coset_rest, COSET_RESTS)
    shared = self.coset_mode == "fragment" and self.coset_order in ("cyclic", "random", "fixed")
    if self.coset_rest != "step" and not shared:
      fail("outer.codec.coset_rest", self.coset_rest, f"'step' with coset_mode={self.coset_mode!r}, "
           f"coset_order={self.coset_order!r} (keep / anchor need coset_mode='fragment' and a shared coset_order: "
           "cyclic, random or fixed)")
    if not self.coset_kappa >= 0:
      fail("outer.codec.coset_kappa", self.coset_kappa, "a number ≥ 0 (0 = the default for coset_bits)")


@dataclasses.dataclass(frozen=True)
class OverlapConfig(Section):
  """`config.outer.overlap`: streaming overlap (docs/method.md §13), for the methods whose round is given
  in parts, with any codec: τ inner steps run while a round's exchange is in flight; its group mean is
  merged after step tH + τ. With outer.schedule='async': up to τ inner steps run while the round finds
  its partner and exchanges; it is merged after the first step by which it is done (docs/async.md §3)."""
  PATH = "outer.overlap"

  steps: int = 0  # τ, in [0, inner_steps); 0 = wait for the exchange.
  # λ of the delayed merge θ ← λ·θ_local + (1 − λ)·φ_new (Streaming DiLoCo's mixing factor; 0.5 there):
  # the share of the τ in-flight steps' progress a replica keeps. 0 discards it; 1 never pulls θ to φ.
  mix: float = 0.5

  def check(self) -> None:
    at_least("outer.overlap.steps", self.steps, 0)
    if not 0 <= self.mix <= 1:
      fail("outer.overlap.mix", self.mix, "a number in [0, 1]")


@dataclasses.dataclass(frozen=True)
class StreamingConfig(Section):
  """`config.outer.streaming`: fragment streaming (noloco_jax/outer/streaming.py, docs/compression.md), for the
  methods whose round is given in parts, with any codec but coset, lock-step (with or without overlap) or
  asynchronous (every fragment round matched with its own partner: partners='own'):
  the message is cut into `fragments` parts and fragment f has its round at the steps t with
  (t − f·H/F) mod H = 0 (Streaming DiLoCo's schedule): each fragment still once per H steps, the traffic
  spread over the round."""
  PATH = "outer.streaming"

  fragments: int = 1  # F, dividing outer.inner_steps; 1 = the whole message every H steps (no streaming).
  # slices: the message's values end to end (the leaves flattened, in tree order) cut into F equal ranges (peak
  # bytes ÷ F) |
  # layers: the stacked layers cut into F contiguous blocks, the embedding in the first, the head in the last.
  split: str = "slices"
  # shared: fragment f's j-th round pairs as the unfragmented round j would | own: every fragment's round a
  # grouping of its own (a new seeded draw per fragment per round; the asynchronous schedule's only choice).
  partners: str = "shared"

  def check(self) -> None:
    at_least("outer.streaming.fragments", self.fragments, 1)
    one_of("outer.streaming.split", self.split, STREAM_SPLITS)
    one_of("outer.streaming.partners", self.partners, STREAM_PARTNERS)


@dataclasses.dataclass(frozen=True)
class AsyncConfig(Section):
  """`config.outer.asynchronous`: the asynchronous schedule (outer.schedule='async', docs/async.md): one
  replica per process, each process trains at its own pace and, after its H inner steps, is paired at run
  time with another process that is ready."""
  PATH = "outer.asynchronous"

  # Seconds a ready process may wait for a partner; none by then: the exchange is skipped (counted:
  # async/skipped_rounds), the replica trains on.
  max_wait_s: float = 5.0
  # A batch of ready processes stays open this long for more to arrive before it is grouped
  # (noloco_jax/asynchronous/law.py); 0 pairs the first two that are ready.
  match_window_s: float = 0.05
  # λ of the staleness-weighted update (outer/async_rules.py): a member's message counts exp(−λ · lag)
  # with lag its progress behind the group's front-runner, in rounds. 0 = no discount; ln 2 ≈ 0.693 halves
  # a message per round behind.
  staleness_decay: float = 0.693
  # An exchange that has not completed after this many seconds fails (counted: async/failed_rounds) and the
  # state stays as it was: the partner died, stalled or gave up.
  exchange_timeout_s: float = 30.0
  # A process whose heartbeat (every lease_s / 10 s) has not moved for this long is held lost (logged): never
  # grouped while it is. One whose heartbeat moves again (it was stopped or starved, not dead) has returned
  # (logged) and is grouped again; a restarted one is a new member (asynchronous/liveness.py).
  lease_s: float = 10.0
  # A partner whose heartbeat has not moved for this long (stopped: SIGSTOP, a frozen host) is given up on at
  # once: the exchange fails as a timed-out one does (state as it was), or a batch it opened is closed without
  # it, rather than after exchange_timeout_s. Its heartbeat is a thread that beats while it computes,
  # compiles or saves, so a partner that is only slow is waited for (asynchronous/liveness.py).
  partner_silence_s: float = 3.0
  match_odd: str = "triple"  # an odd batch of ready processes: "triple" (one group of three) or "leave_out".
  # How long a (re)started process waits for the live peer it asked for its state (the peer serves it at its
  # next round boundary) before it asks another.
  join_timeout_s: float = 300.0

  def check(self) -> None:
    for name, ok, valid in (("max_wait_s", self.max_wait_s > 0, "a number of seconds > 0"),
                            ("match_window_s", self.match_window_s >= 0, "a number of seconds ≥ 0"),
                            ("staleness_decay", self.staleness_decay >= 0, "a number ≥ 0 (0 turns the discount off)"),
                            ("exchange_timeout_s", self.exchange_timeout_s > 0, "a number of seconds > 0"),
                            ("lease_s", self.lease_s >= 1, "a number of seconds ≥ 1 (several heartbeats per lease)"),
                            ("partner_silence_s", self.partner_silence_s >= 1,
                             "a number of seconds ≥ 1 (several heartbeats: one every min(0.5, lease_s / 10) s)"),
                            ("join_timeout_s", self.join_timeout_s > 0, "a number of seconds > 0")):
      if not ok:
        fail(f"outer.asynchronous.{name}", getattr(self, name), valid)
    one_of("outer.asynchronous.match_odd", self.match_odd, MATCH_ODD)


def _moved(section: str, names) -> dict[str, str]:
  return {name: f"{section}.{name}" for name in names}


@dataclasses.dataclass(frozen=True)
class OuterConfig(Section):
  PATH = "outer"
  RENAMED = {
      "momentum": "rule.outer_momentum", "lr": "rule.outer_lr", "gamma": "rule.consensus_weight",
      **_moved("rule", ("group_size", "outer_momentum", "outer_lr", "consensus_weight", "nesterov", "fanout",
                        "topology", "allreduce_algorithm")),
      **_moved("codec", ("message_dtype", "compression", "topk_density", "topk_bits", "slow_codec", "feedback_decay")),
      "compression_chunk": "codec.chunk", "overlap_steps": "overlap.steps", "overlap_mix": "overlap.mix",
      **_moved("asynchronous", ("max_wait_s", "match_window_s", "staleness_decay", "exchange_timeout_s", "lease_s",
                                "match_odd", "join_timeout_s")),
  }
  UNSET = dict(inner_steps=50)  # what "at its default" meant before inner_steps could be unset

  kind: str = dataclasses.field(default_factory=default_kind)  # the method: one of noloco_jax/outer/methods/
  inner_steps: int | None = None  # H: inner steps per outer round (unset: the kind's value, e.g. 50 for noloco).
  # The round schedule (docs/async.md): "lockstep" = every replica runs round r together (a compiled
  # program over the mesh); "async" = one replica per process, each at its own pace, paired at run time
  # with another process that is ready (outer.asynchronous.*).
  schedule: str = "lockstep"
  # How the groups are drawn each round (noloco_jax/outer/pairing.py):
  #   fresh       = a new uniformly random grouping every round (the method); on a mesh the next round's
  #                 program is compiled while the current round's inner steps run (outer/programs.py);
  #   round_robin = one of the N-1 round-robin matchings (relabelled once), uniform per round; one program;
  #                 every pair meets equally often, but only N-1 matchings occur (group_size 2 only);
  #   fixed       = the same grouping every round (ablation).
  pairing: str = "fresh"
  # Storage dtype of the outer state (φ, δ; DiLoCo's φ and momentum): "" = the parameters' dtype,
  # or float32 | bfloat16. The update itself always computes in float32.
  state_dtype: str = ""
  # Keep φ and δ in pinned host memory between rounds (they are read once per round): the device then
  # holds three model-sized copies (θ, Adam m, v) instead of five. Costs two host<->device copies per round.
  offload: bool = False
  # Validation refuses a rule whose cross-replica spread is mean-square unstable (the method's stability
  # analysis, docs/stability.md; config/checks.py); True runs it anyway, with a warning.
  allow_unstable: bool = False
  rule: RuleConfig = dataclasses.field(default_factory=RuleConfig)
  codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
  overlap: OverlapConfig = dataclasses.field(default_factory=OverlapConfig)
  streaming: StreamingConfig = dataclasses.field(default_factory=StreamingConfig)
  asynchronous: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)

  def __post_init__(self):
    # Unset per-kind fields take the kind's value (module docstring); which ones did is kept for the log
    # and for a config file's ConfigDict (`unset_fields`).
    defaults = METHODS[self.kind].defaults if self.kind in METHODS else {}
    unset = ("inner_steps",) if self.inner_steps is None else ()
    if unset:
      object.__setattr__(self, "inner_steps", defaults.get("inner_steps", self.UNSET["inner_steps"]))
    rule_unset = tuple(name for name in RuleConfig.UNSET if getattr(self.rule, name) is None)
    if rule_unset:
      rule = dataclasses.replace(self.rule, **{name: defaults.get(name, RuleConfig.UNSET[name]) for name in rule_unset})
      object.__setattr__(rule, "_unset", rule_unset)
      object.__setattr__(self, "rule", rule)
    object.__setattr__(self, "_unset", unset)

  def unset_fields(self) -> tuple[str, ...]:
    return self._unset

  @property
  def spec(self):
    """The kind's spec (noloco_jax/outer/methods/)."""
    return spec(self.kind)

  def value(self, name: str) -> Any:
    """A field the kind may read, by its name: `inner_steps`, or a field of `rule`."""
    return getattr(self.rule, name) if name in _RULE_FIELDS else getattr(self, name)

  def from_spec(self) -> dict[str, Any]:
    """{field: value} of the hyperparameters in force that were left unset and took the kind's value."""
    unset = (*self._unset, *self.rule.unset_fields())
    return {name: self.value(name) for name in self.spec.reads if name in unset}

  def in_force(self) -> dict[str, Any]:
    """{field: value} of every outer hyperparameter this kind uses, the values it fixes itself included."""
    return {**self.spec.fixed, **{name: self.value(name) for name in self.spec.reads}}

  @classmethod
  def parse(cls, node) -> "OuterConfig":
    section = super().parse(node)
    taken = section.from_spec()
    if section is not node and taken:
      s = section.spec
      source = (f"paper's defaults for {s.kind}" if s.in_paper else
                f"defaults for {s.kind}, which the paper does not run ({s.not_in_paper})")
      cells = ", ".join(f"{'' if name == 'inner_steps' else 'rule.'}{name}={value!r}" for name, value in taken.items())
      message = (f"config.outer.kind={s.kind!r}: {cells} from the {source} ({s.module}); set a field to "
                 "override it.")
      if message not in _logged:
        _logged.add(message)
        logging.info("%s", message)
    return section

  def check(self) -> None:
    s = spec(self.kind)
    at_least("outer.inner_steps", self.inner_steps, 1)
    one_of("outer.state_dtype", self.state_dtype, STATE_DTYPES)
    one_of("outer.pairing", self.pairing, PAIRINGS)
    r = self.rule
    if self.pairing == "round_robin" and s.grouped and r.group_size != 2:
      fail("outer.pairing", self.pairing, f"'fresh' or 'fixed' with group_size={r.group_size} ('round_robin' "
           "pairs replicas: group_size 2 only)")
    if not 0 <= r.outer_momentum < 1:
      fail("outer.rule.outer_momentum", r.outer_momentum, "a number in [0, 1)")
    if not r.outer_lr > 0:
      fail("outer.rule.outer_lr", r.outer_lr, "a number > 0")
    if s.grouped and r.group_size < 2:
      fail("outer.rule.group_size", r.group_size, "an integer ≥ 2 (a group averages at least two replicas)")
    if r.topology != RuleConfig.topology and "topology" not in s.exchange:
      readers = " or ".join(f"outer.kind={k!r}" for k, m in METHODS.items() if "topology" in m.exchange)
      fail("outer.rule.topology", r.topology, f"'oracle' (the default) with outer.kind={self.kind!r} (a topology "
           f"is read by {readers} alone)")
    in_parts = " and ".join(k for k, m in METHODS.items() if m.parts)
    if self.codec.compression != "none" and not s.parts:
      fail("outer.codec.compression", self.codec.compression,
           f"'none' with outer.kind={self.kind!r} (compressed messages exist for {in_parts})")
    if self.codec.message_dtype != CodecConfig.message_dtype and "message_dtype" not in s.exchange:
      readers = ", ".join(k for k, m in METHODS.items() if "message_dtype" in m.exchange)
      fail("outer.codec.message_dtype", self.codec.message_dtype,
           f"'float32' with outer.kind={self.kind!r} (its round sends no message in a chosen dtype; {readers} do)")
    if not self.overlap.steps < self.inner_steps:
      fail("outer.overlap.steps", self.overlap.steps,
           f"an integer in [0, outer.inner_steps − 1] = [0, {self.inner_steps - 1}] (the exchange of one round "
           "is merged before the next round's is sent)")
    if self.overlap.steps and not s.parts:
      fail("outer.overlap.steps", self.overlap.steps,
           f"0 with outer.kind={self.kind!r} (the overlapped exchange exists for {in_parts})")
    self._check_coset()  # before the schedule's checks: its own reason names the schedule
    self._check_streaming(s, in_parts)
    self._check_schedule(s, in_parts)

  def _check_streaming(self, s, in_parts: str) -> None:
    """Fragment f's round falls at the steps ≡ f·H/F (mod H): F must divide H, an overlapped fragment's
    exchange must be merged before the next fragment's is sent; in the asynchronous schedule every fragment round
    finds its own partner (partners='own')."""
    F = self.streaming.fragments
    if F == 1:
      return
    field = "outer.streaming.fragments"
    if not s.parts:
      fail(field, F, f"1 with outer.kind={self.kind!r} (fragments exist for the methods given in parts: {in_parts})")
    if self.inner_steps % F:
      fail(field, F, f"a divisor of outer.inner_steps={self.inner_steps} (fragment f's round is at the steps "
           "f·H/F mod H)")
    if not self.overlap.steps < self.inner_steps // F:
      fail("outer.overlap.steps", self.overlap.steps, f"an integer in [0, {self.inner_steps // F - 1}] with "
           f"outer.streaming.fragments={F} (one fragment's exchange is merged before the next one's is sent, "
           f"H/F = {self.inner_steps // F} steps later)")
    if self.codec.compression == "coset":
      fail(field, F, "1 with outer.codec.compression='coset' (the coset codec sends fragments of its own)")
    if self.schedule == "async" and self.streaming.partners != "own":
      fail("outer.streaming.partners", self.streaming.partners, "'own' with outer.schedule='async' (each fragment "
           "round is matched at run time with whichever process is ready for that fragment)")
    if self.offload:
      fail(field, F, "1 with outer.offload=True (not supported with fragment streaming)")

  def _check_coset(self) -> None:
    """The coset codec (outer/coset.py) is built for pairs in lock-step: its scale estimate reads a pair's
    mean, and it decodes against the receiver's own message of the same step."""
    if self.codec.compression != "coset":
      return
    needs = lambda value, why: f"{value} with outer.codec.compression='coset' ({why})"
    if self.rule.group_size != 2:
      fail("outer.rule.group_size", self.rule.group_size, needs("2", "its scale estimate reads a pair's mean"))
    if self.overlap.steps:
      fail("outer.overlap.steps", self.overlap.steps, needs("0", "not with streaming overlap"))
    if self.schedule != "lockstep":
      fail("outer.schedule", self.schedule, needs("'lockstep'", "not in the asynchronous schedule"))

  def _check_schedule(self, s, in_parts: str) -> None:
    one_of("outer.schedule", self.schedule, SCHEDULES)
    if self.schedule != "async":
      return
    with_async = lambda what: f"{what} with outer.schedule='async'"
    if not s.parts:
      fail("outer.schedule", self.schedule, f"'lockstep' with outer.kind={self.kind!r} (the asynchronous schedule "
           f"runs {in_parts}: pairs found at run time, no all-reduce)")
    if self.rule.group_size != 2:
      fail("outer.rule.group_size", self.rule.group_size, with_async("2") + " (ready processes are paired; an odd "
           "one out joins a pair, outer.asynchronous.match_odd)")
    if self.pairing != "fresh":
      fail("outer.pairing", self.pairing, with_async("'fresh'") + " (the partners are found at run time among "
           "the processes that are ready)")
    if self.offload:
      fail("outer.offload", self.offload, with_async("False") + " (not supported by the asynchronous schedule)")


_RULE_FIELDS = frozenset(f.name for f in dataclasses.fields(RuleConfig))
