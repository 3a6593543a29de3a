"""NoLoCo's whole message in 1–2 % of float32: a fragment, coded against the receiver's own message.

A NoLoCo round needs, from the partner j, its message c_j = β·θ_j + (γ − β)·φ_j. Most of c_j is the slow
weights, which the partners share up to the replicas' spread, so what replica i does not already know is
the difference D = c_j − c_i (measured on the default job: rms(D) is 1–5 % of rms(c) and 3–6× the round's
own progress β·(θ − φ)). Neither side knows D, and partners are new every round. So:

1. **Coset (Wyner–Ziv) codes against the receiver's own message.** j sends b bits per coded value: with a
   lattice step ε and a dither u ∈ [−½, ½) drawn from a key both sides share,

       k = round(c_j / ε + u),   code = k mod 2^b,

   and i decodes against its own c_i: the integer k̂ ≡ code (mod 2^b) nearest to y = c_i / ε + u,

       k̂ = code + 2^b · round((y − code) / 2^b),   ĉ_j = (k̂ − u) · ε.

   k̂ = k whenever |D| / ε < 2^(b−1) − ½, and then ĉ_j − c_j = (k − (c_j/ε + u))·ε is uniform on
   [−ε/2, ε/2) and independent of c_j (subtractive dither): unbiased, variance ε²/12. A larger |D| wraps
   (k̂ = k ± 2^b·…), but the decoded difference always stays within ±(2^(b−1) + ½)·ε of c_i.
   No state about the partner is needed, and nothing is fed back: what is not sent stays in the sender's
   own weights and reaches the others through later rounds.
2. **A fragment: which values are coded** (`mode`). Elsewhere the receiver takes the partner's value to be
   its own (its best guess), and the round is a local outer step there, δ ← α·δ + β·(θ − φ) (`rest='step'`),
   unless `rest` says otherwise (3.).
   - `fragment`: each leaf is cut into blocks of `block` values and m = ceil(density · blocks) of them are
     sent (`order`): `cyclic` walks a per-run random permutation of the blocks, m at a time (every block
     once per ceil(blocks / m) rounds), `random` draws a new m-subset per round, `fixed` sends the same
     random m blocks every round — all from the shared key, so no indices travel; `fisher` sends the sender's m blocks of largest mean Adam second moment ν
     (the diagonal Fisher: a difference D costs a replica's loss about ½·Σ ν·D²), with their indices;
     `mixed` half of them so and half cyclic; `damage` the largest ν × (rounds since the block was last
     averaged + 1).
   - `sum`: every group of g = 1/density consecutive values as one signed sum Σ s_a·c_a (random signs,
     shared, new every round); the receiver moves each value by s_a·(T̂_j − T_i)/g (D projected on the
     round's random direction s).
   - `global`: one fragment of the whole message's blocks, the sender's blocks of largest ν × its leaf's
     spread estimate, across leaves (indices and one exponent per block travel).

3. **Off the fragment** (`rest`, mode `fragment` with a shared order): `step` (the default) is the round's
   rule with the partner's value taken to be the receiver's own, i.e. the local outer step above. `keep`
   takes no outer step there, as if the replica had no partner: θ stays as trained, the anchor φ ← θ, δ
   stays as it was (what independent replicas do on those values). `anchor` leaves θ, φ and δ as they
   were: the value trains on from θ and its pseudo-gradient θ − φ keeps growing until the value is next in
   a fragment, whose round then applies all of it (Streaming DiLoCo's schedule per block, with period
   ⌈1/density⌉·H under `cyclic`; no residual: the anchor is the feedback). `off_fragment` is the rule.

The lattice step is set by the sender per leaf: ε = 2^e, e = round(log2(κ·s)), from s² = max(h, 2·ms(β·(θ − φ)))
(× g for a sum of g values): h is its running estimate of ms(D) (from what it decoded from its previous
partners, `observe`), and 2·ms(β·(θ − φ)) covers the first rounds, where the replicas differ only by this
round's progress. e travels with the codes (one int8 per leaf), so the two sides need not agree on h. A
power of two makes c / ε and (k̂ − u)·ε exact, and makes ε immune to the last-bit differences of a sum
computed by two programs (the mesh's and the simulator's reduce in different orders).

`bits=32` / `16` send the fragment's values as they are (float32 / bfloat16): the linear shared-subset route
(compress(c_j) − compress(c_i) is then exactly the fragment of D), for comparison.

Every function here is pure and works on ONE replica's arrays (vmap over a stack). The payload is the
operands of the collectives: `{"round": int32[], "leaves": [{"codes": uint8[...], "exp": int8[],
"index": uint16/int32[m] (sender-chosen orders)}]}`, or for `global` `{"round", "index", "exp", "codes"}`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.outer import compression

SENDER_CHOSEN = ("fisher", "mixed", "damage")  # orders whose blocks the sender picks (their indices travel)
RAW_BITS = {32: jnp.float32, 16: jnp.bfloat16}  # bits that send the fragment's values as they are
# κ = ε / rms(D) by bits. b = 2, 3, 4: chosen offline on the default job's messages (the capture
# 1 − ms(ĉ − c) / ms(D), swept over κ with per-leaf scales: b = 2: 0.56 at κ = 2.0; b = 3: 0.84 at 1.3; b = 4:
# 0.95 at 0.6; python experiments/bench_compression.py --capture). b ≥ 5, not measured: the decodable range
# 2^(b−1)·κ kept at 4.8 rms(D), b = 4's.
DEFAULT_KAPPA = {2: 2.0, 3: 1.3, 4: 0.6, 5: 0.3, 6: 0.15, 7: 0.075, 8: 0.0375}
_FRAGMENT, _DITHER, _SIGNS = 0, 1, 2  # purposes folded into the run's key


def fragment_count(num_blocks: int, density: float) -> int:
  """m: blocks sent per round, at least one."""
  return max(1, min(num_blocks, math.ceil(density * num_blocks)))


def fragment_index(key, leaf: int, round_, num_blocks: int, count: int, order: str):
  """int32[count]: the blocks of leaf `leaf` sent in round `round_` (traced), the same on every replica."""
  leaf_key = jax.random.fold_in(jax.random.fold_in(key, _FRAGMENT), leaf)
  if order == "random":
    return jax.random.permutation(jax.random.fold_in(leaf_key, round_), num_blocks)[:count].astype(jnp.int32)
  if order == "fixed":  # the same random blocks every round (a control for `fisher`'s fixed choice)
    round_ = 0
  perm = jax.random.permutation(leaf_key, num_blocks).astype(jnp.int32)
  start = (round_ * count) % num_blocks
  return perm[(start + jnp.arange(count, dtype=jnp.int32)) % num_blocks]


def dither(key, leaf: int, round_, shape):
  """u ∈ [−½, ½) per value, shared by the pair."""
  k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, _DITHER), leaf), round_)
  return jax.random.uniform(k, shape, jnp.float32, -0.5, 0.5)


def coset_encode(x, eps, u, bits: int):
  """uint8 codes k mod 2^b of k = round(x / ε + u)."""
  k = jnp.round(x / eps + u)
  return jnp.mod(k, 2 ** bits).astype(jnp.uint8)


def coset_decode(codes, side, eps, u, bits: int):
  """ĉ = (k̂ − u)·ε, k̂ the integer ≡ code (mod 2^b) nearest to side / ε + u."""
  levels = 2.0 ** bits
  code = codes.astype(jnp.float32)
  y = side / eps + u
  k_hat = code + levels * jnp.round((y - code) / levels)
  # One rounding of one product, kept from fusing into the sums that follow (as compression.dequantize).
  return jax.lax.optimization_barrier((k_hat - u) * eps)


MIN_EXPONENT, MAX_EXPONENT = -126, 127  # ε = 2^e stays a normal float32


def lattice_exponent(s2, c, kappa: float):
  """int8 e with ε = 2^e ≈ κ·√s²: e = round(log2(κ·√s²)), at least floor(log2(max|c|)) − 20 so that c / ε
  stays well inside float32's exact integers (a zero leaf: the smallest normal step)."""
  want = jnp.round(jnp.log2(kappa * jnp.sqrt(s2)))
  floor = jnp.floor(jnp.log2(jnp.max(jnp.abs(c)))) - 20
  e = jnp.maximum(want, floor)  # log2(0) = −inf on both sides of a zero leaf
  return jnp.clip(jnp.where(jnp.isfinite(e), e, MIN_EXPONENT), MIN_EXPONENT, MAX_EXPONENT).astype(jnp.int8)


def step_of(exponent):
  """ε = 2^e, exactly."""
  return jnp.ldexp(jnp.float32(1.0), exponent.astype(jnp.int32))


def tree_sum(x):
  """Sum over the last axis (a power of two) by pairwise adds in a fixed order: the same bits in every
  program (a reduction may be reordered by XLA; elementwise adds are not)."""
  while x.shape[-1] > 1:
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def signs(key, leaf: int, round_, shape):
  """±1 per value (float32), shared by the pair: the round's random sign pattern of `sum` mode."""
  k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, _SIGNS), leaf), round_)
  return jax.random.rademacher(k, shape, jnp.float32)


MODES = ("fragment", "sum", "global")


def off_fragment(rest: str, on, theta, phi, delta, new_phi, new_delta):
  """One leaf's (θ, φ, δ) after a round, given the round's rule everywhere (new_φ, new_δ; θ ← new_φ) and
  `on` (1.0 on the fragment's values, 0.0 elsewhere): `step` the rule everywhere; off the fragment `keep`
  (θ, θ, δ) and `anchor` (θ, φ, δ), all as they were before the round. float32 in, float32 out."""
  if rest == "step":
    return new_phi, new_phi, new_delta
  pick = lambda a, b: jnp.where(on > 0, a, b)
  return (pick(new_phi, theta), pick(new_phi, theta if rest == "keep" else phi), pick(new_delta, delta))


@dataclasses.dataclass(frozen=True)
class CosetCodec:
  """`outer.codec.compression=coset`: the whole NoLoCo message in coset codes against the receiver's own (module doc).

  `mode` says which values of a leaf are coded each round:
  - `fragment`: the values of a shared fragment of its blocks (density of them), the rest not at all;
  - `sum`: every group of g = 1/density consecutive values as one signed sum Σ s_a·c_a (random signs
    s, shared, new every round). The receiver decodes the partner's sum T̂_j against its own T_i and
    moves each value of the group by s_a·(T̂_j − T_i)/g: the pair's difference D projected on the
    round's random direction s (its component s·(s·D)/g), on every value, every round.

  The codec keeps a small state per replica, `{"h": ms estimate of the coded values' difference, "eps":
  last ε}` (one float32 each per leaf), in `TrainState.outer["codec"]` (outer/base.group_rule carries it).
  Its decode needs the receiver's own message (side information); `observe` updates h from a round's
  group mean.
  """
  density: float
  bits: int
  block: int = 256
  order: str = "cyclic"
  kappa: float = 0.0  # 0: DEFAULT_KAPPA[bits]
  inner_steps: int = 1  # H: round r is sent after step r·H
  seed: int = 0
  memory: float = 0.5  # h ← memory·h + (1 − memory)·(ms of the decoded difference)
  beta: float = 0.7
  mode: str = "fragment"
  scale: str = "leaf"  # leaf: one ε per leaf | block: one ε per block, from a running estimate per block
  rest: str = "step"  # the rule off the fragment: step | keep | anchor (module doc, 3.; off_fragment)
  feedback = False  # no error-feedback residual: what is not sent stays in the replica's own weights
  side_info = True

  @property
  def informed(self) -> bool:
    """Whether `encode` reads the sender's Adam second moment (its sender-chosen blocks)."""
    return (self.mode == "fragment" and self.order in SENDER_CHOSEN) or self.mode == "global"

  @property
  def raw(self) -> bool:
    return self.bits in RAW_BITS

  @property
  def key(self):
    return jax.random.PRNGKey(self.seed)

  @property
  def group(self) -> int:
    """g of `sum` mode: 1/density, a power of two."""
    g = round(1 / self.density)
    if g < 1 or g & (g - 1) or abs(g * self.density - 1) > 1e-9:
      raise ValueError(f"coset mode 'sum' needs a density 1/g with g a power of two, not {self.density}")
    return g

  def _kappa(self) -> float:
    return self.kappa or DEFAULT_KAPPA[self.bits]

  def _layout(self, n: int) -> tuple[int, int, int]:
    num, width = compression.chunk_shape(n, self.block)
    return num, width, fragment_count(num, self.density)

  def init_state(self, params):
    leaves = jax.tree.leaves(params)
    zeros = [jnp.zeros((), jnp.float32) for _ in leaves]
    state = {"h": zeros, "eps": list(zeros)}
    if self.scale == "block":  # per block: the ms(D) estimate and the last ε this replica used
      state["hb"] = [jnp.zeros((self._layout(x.size)[0],), jnp.float32) for x in leaves]
      state["eb"] = [jnp.zeros((self._layout(x.size)[0],), jnp.float32) for x in leaves]
    if self.order == "damage":  # rounds since this replica last averaged each block
      state["age"] = [jnp.zeros((self._layout(x.size)[0],), jnp.float32) for x in leaves]
    return state

  # ---- which values are coded: project a leaf to them, lift a decoded difference back ----

  def _groups(self, x):
    g = self.group
    flat = jnp.ravel(x).astype(jnp.float32)
    return jnp.pad(flat, (0, -flat.size % g)).reshape(-1, g)

  def choose(self, x, leaf: int, round_, importance=None, age=None):
    """int32[m]: the fragment's blocks of leaf x in round `round_`. cyclic / random: the shared schedule;
    fisher: the m blocks of largest mean `importance` (the sender's Adam second moment: the expected loss
    damage ½·Σ v·D² of a difference D of even size is largest there); mixed: half of them so, the other
    half the cyclic schedule's (so that every block is still averaged now and then)."""
    num, width, m = self._layout(x.size)
    if self.order not in SENDER_CHOSEN:
      return fragment_index(self.key, leaf, round_, num, m, self.order)
    score = jnp.mean(compression.to_chunks(importance, width), axis=-1)
    if self.order == "damage":  # expected damage ∝ v · (the divergence grown since last averaged ∝ age + 1)
      score = score * (age + 1.0)
    if self.order == "mixed":
      cyclic = fragment_index(self.key, leaf, round_, num, m - m // 2, "cyclic")
      score = score.at[cyclic].set(jnp.inf)  # taken first; the best-scoring others fill the rest
    return jax.lax.top_k(score, m)[1].astype(jnp.int32)

  def project(self, x, leaf: int, round_, idx=None):
    """The values of leaf x coded in round `round_` (a fragment's blocks `idx`, or the signed group sums)."""
    if self.mode == "sum":
      x_GxS = self._groups(x)
      return tree_sum(signs(self.key, leaf, round_, x_GxS.shape) * x_GxS)
    num, width, m = self._layout(x.size)
    if idx is None:
      idx = fragment_index(self.key, leaf, round_, num, m, self.order)
    return compression.to_chunks(x, width)[idx]

  def lift(self, own, coded_own, coded_partner, leaf: int, round_, idx=None):
    """The partner's leaf as the receiver reconstructs it from its decoded values: its own leaf, moved
    by the decoded difference where it has one."""
    if self.mode == "sum":
      x_GxS = self._groups(own)
      s = signs(self.key, leaf, round_, x_GxS.shape)
      moved = x_GxS + s * ((coded_partner - coded_own) / self.group)[:, None]
      return moved.reshape(-1)[:own.size].reshape(own.shape)
    num, width, m = self._layout(own.size)
    if idx is None:
      idx = fragment_index(self.key, leaf, round_, num, m, self.order)
    return compression.from_chunks(compression.to_chunks(own, width).at[idx].set(coded_partner), own.shape)

  def _coded_ms(self, sum_sq, n: int):
    """ms of the coded values' difference from Σ over the leaf of (2·(mean − own))² (a pair's mean)."""
    if self.mode == "sum":
      g = self.group
      return sum_sq * g * g / (-(-n // g) * g)  # each group holds g values moved by ±(T̂ − T)/g
    num, width, m = self._layout(n)
    return sum_sq / min(m * width, n)  # values of the leaf on the fragment (padding carries zeros)

  def _fallback_ms(self, fresh):
    """ms of the coded values' difference when the replicas differ by this round's progress only:
    2·ms(β·(θ − φ)) per value; a signed sum of g independent values has g times that."""
    return 2.0 * jnp.mean(jnp.square(fresh)) * (self.group if self.mode == "sum" else 1)

  def coverage(self, like, step):
    """1.0 on the values of the round at `step` sends (its fragment), 0.0 elsewhere: a float32 tree like
    `like` (mode `fragment`, a shared order: the blocks are known from the round alone)."""
    round_ = (step // self.inner_steps).astype(jnp.int32)
    out = []
    leaves, treedef = jax.tree.flatten(like)
    for leaf, x in enumerate(leaves):
      num, width, m = self._layout(x.size)
      idx = fragment_index(self.key, leaf, round_, num, m, self.order)
      out.append(compression.from_chunks(jnp.zeros((num, width), jnp.float32).at[idx].set(1.0), x.shape))
    return treedef.unflatten(out)

  # ---- the codec ----

  def encode(self, message, theta, phi, state, step, importance=None):
    """One replica's message c (float32 tree), θ, φ, codec state and step -> (payload, new state).
    `importance`: a tree like c (the sender's Adam second moment), for the sender-chosen orders."""
    round_ = (step // self.inner_steps).astype(jnp.int32)
    if self.mode == "global":
      return self._encode_global(message, theta, phi, state, round_, importance)
    leaves = []
    eps_out = []
    c_leaves = jax.tree.leaves(message)
    fresh = [self.beta * (t.astype(jnp.float32) - p.astype(jnp.float32))
             for t, p in zip(jax.tree.leaves(theta), jax.tree.leaves(phi))]
    weights = jax.tree.leaves(importance) if importance is not None else [None] * len(c_leaves)
    ages = state.get("age", [None] * len(c_leaves))
    eb_out = []
    for leaf, (c, d, h, w, age) in enumerate(zip(c_leaves, fresh, state["h"], weights, ages)):
      chosen = self.mode == "fragment" and self.order in SENDER_CHOSEN
      idx = self.choose(c, leaf, round_, w, age) if chosen else None
      x = self.project(c, leaf, round_, idx)
      # Block indices travel as uint16 while a leaf has at most 65,536 blocks.
      extra = {"index": idx.astype(jnp.uint16 if self._layout(c.size)[0] <= 65536 else jnp.int32)} if chosen else {}
      if self.raw:
        leaves.append({"values": x.astype(RAW_BITS[self.bits]), **extra})
        eps_out.append(jnp.zeros((), jnp.float32))
        continue
      if self.scale == "block":  # ε per block of the fragment, from this block's own estimate
        num, width, m = self._layout(c.size)
        if idx is None:
          idx = fragment_index(self.key, leaf, round_, num, m, self.order)
        fallback = 2.0 * jnp.mean(jnp.square(compression.to_chunks(d, width)), axis=-1)[idx]
        exponent = jax.vmap(lambda v, row: lattice_exponent(v, row, self._kappa()))(
            jnp.maximum(state["hb"][leaf][idx], fallback), x)
        eps = step_of(exponent)[:, None]
        eb_out.append(state["eb"][leaf].at[idx].set(eps[:, 0]))
      else:
        exponent = lattice_exponent(jnp.maximum(h, self._fallback_ms(d)), x, self._kappa())
        eps = step_of(exponent)
      u = dither(self.key, leaf, round_, x.shape)
      leaves.append({"codes": compression.pack_bits(coset_encode(x, eps, u, self.bits), self.bits), "exp": exponent,
                     **extra})
      eps_out.append(jnp.sqrt(jnp.mean(jnp.square(eps))))
    new_state = {**state, "eps": eps_out}
    if self.scale == "block":
      new_state["eb"] = eb_out
    return {"round": round_, "leaves": leaves}, new_state

  def decode(self, payload, own):
    """The partner's message as this replica reconstructs it (`lift` of the decoded values)."""
    round_ = payload["round"]
    if self.mode == "global":
      return self._decode_global(payload, own)
    own_leaves, treedef = jax.tree.flatten(own)
    out = []
    for leaf, (c, p) in enumerate(zip(own_leaves, payload["leaves"])):
      idx = p["index"].astype(jnp.int32) if "index" in p else None
      side = self.project(c, leaf, round_, idx)
      if self.raw:
        values = p["values"].astype(jnp.float32)
      else:
        u = dither(self.key, leaf, round_, side.shape)
        codes = compression.unpack_bits(p["codes"], self.bits, side.shape)
        eps = step_of(p["exp"])
        values = coset_decode(codes, side, eps[:, None] if eps.ndim else eps, u, self.bits)
      out.append(self.lift(c, side, values, leaf, round_, idx))
    return treedef.unflatten(out)

  def observe(self, state, own, mean):
    """h ← memory·h + (1 − memory)·(ms of the decoded difference of the coded values, less the dither's
    ε²/12). For a pair, 2·(mean − own) is the lifted decoded difference (0 where nothing was sent)."""
    h_out = []
    for c, g, h, eps in zip(jax.tree.leaves(own), jax.tree.leaves(mean), state["h"], state["eps"]):
      if self.mode == "global":  # this leaf's share of the fragment varies: the blocks that moved
        moved = jnp.sum(jnp.square(self._blocks(g - c)), axis=-1) > 0
        count = jnp.maximum(jnp.minimum(jnp.sum(moved) * self.block, c.size), 1)
        ms = jnp.sum(jnp.square(2.0 * (g - c))) / count
        ms = jnp.maximum(ms - jnp.square(eps) / 12.0, 0.0)
        h_out.append(jnp.where(jnp.any(moved), jnp.where(h > 0, self.memory * h + (1.0 - self.memory) * ms, ms), h))
        continue
      ms = self._coded_ms(jnp.sum(jnp.square(2.0 * (g - c))), c.size)
      if not self.raw:
        ms = jnp.maximum(ms - jnp.square(eps) / 12.0, 0.0)
      # The first observation (h = 0: nothing decoded yet) is taken as it is.
      h_out.append(jnp.where(h > 0, self.memory * h + (1.0 - self.memory) * ms, ms))
    out = {**state, "h": h_out}
    if "hb" in state:  # per block: the blocks that moved update their estimate
      hb_out = []
      for c, g, hb, eb in zip(jax.tree.leaves(own), jax.tree.leaves(mean), state["hb"], state["eb"]):
        width = self._layout(c.size)[1]
        sq = jnp.square(compression.to_chunks(2.0 * (g - c), width))
        moved = jnp.sum(sq, axis=-1) > 0
        ms = jnp.maximum(jnp.mean(sq, axis=-1) - jnp.square(eb) / 12.0, 0.0)
        hb_out.append(jnp.where(moved, jnp.where(hb > 0, self.memory * hb + (1.0 - self.memory) * ms, ms), hb))
      out["hb"] = hb_out
    if "age" in state:  # a block the partner sent moved (its decoded difference is not all zero): age 0
      ages = []
      for c, g, age in zip(jax.tree.leaves(own), jax.tree.leaves(mean), state["age"]):
        width = self._layout(c.size)[1]
        moved = jnp.sum(jnp.square(compression.to_chunks(g - c, width)), axis=-1) > 0
        ages.append(jnp.where(moved, 0.0, age + 1.0))
      out["age"] = ages
    return out

  # ---- mode "global": one fragment over the whole message, its blocks chosen by expected damage ----

  def _blocks(self, x):
    """[⌈n / block⌉, block]: a leaf cut into blocks of exactly `block` values (zero padded)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    return jnp.pad(flat, (0, -flat.size % self.block)).reshape(-1, self.block)

  def _global_blocks(self, leaves):
    return jnp.concatenate([self._blocks(x) for x in leaves])

  def _leaf_of_block(self, leaves) -> np.ndarray:
    return np.concatenate([np.full(-(-x.size // self.block), i, np.int32) for i, x in enumerate(leaves)])

  def _encode_global(self, message, theta, phi, state, round_, importance):
    c_leaves = jax.tree.leaves(message)
    fresh = [self.beta * (t.astype(jnp.float32) - p.astype(jnp.float32))
             for t, p in zip(jax.tree.leaves(theta), jax.tree.leaves(phi))]
    s2 = [jnp.maximum(h, self._fallback_ms(d)) for h, d in zip(state["h"], fresh)]
    exponents = jnp.stack([lattice_exponent(v, c, self._kappa()) for v, c in zip(s2, c_leaves)])
    leaf_of = self._leaf_of_block(c_leaves)
    blocks = self._global_blocks(c_leaves)
    # Expected damage of leaving a block's difference D unaveraged: ½·Σ ν·E[D²] ≈ mean ν · s² of its leaf.
    score = jnp.mean(self._global_blocks(jax.tree.leaves(importance)), axis=-1) * jnp.stack(s2)[leaf_of]
    m = fragment_count(blocks.shape[0], self.density)
    idx = jax.lax.top_k(score, m)[1].astype(jnp.int32)
    exp = exponents[jnp.asarray(leaf_of)[idx]]
    u = dither(self.key, 0, round_, (m, self.block))
    codes = coset_encode(blocks[idx], step_of(exp)[:, None], u, self.bits)
    index = idx.astype(jnp.uint16 if blocks.shape[0] <= 65536 else jnp.int32)
    payload = {"round": round_, "index": index, "exp": exp, "codes": compression.pack_bits(codes, self.bits)}
    return payload, {**state, "eps": [step_of(e) for e in exponents]}

  def _decode_global(self, payload, own):
    own_leaves, treedef = jax.tree.flatten(own)
    blocks = self._global_blocks(own_leaves)
    idx = payload["index"].astype(jnp.int32)
    side = blocks[idx]
    u = dither(self.key, 0, payload["round"], side.shape)
    codes = compression.unpack_bits(payload["codes"], self.bits, side.shape)
    full = blocks.at[idx].set(coset_decode(codes, side, step_of(payload["exp"])[:, None], u, self.bits))
    out, start = [], 0
    for x in own_leaves:
      count = -(-x.size // self.block)
      out.append(full[start:start + count].reshape(-1)[:x.size].reshape(x.shape))
      start += count
    return treedef.unflatten(out)

  def payload_bytes(self, params) -> int:
    """Bytes of one replica's payload (one message to one partner), from shapes."""
    like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    state = jax.eval_shape(self.init_state, like)
    shapes = jax.eval_shape(lambda c, s: self.encode(c, c, c, s, jnp.int32(0), c)[0], like, state)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))
