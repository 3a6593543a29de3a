"""outer.codec.compression=coset (outer/coset.py): the codec's math and a whole round against NumPy, its shared
randomness, mesh = simulator, and its bytes in the compiled program."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.inner.state import TrainState
from noloco_jax.config.outer import OuterConfig
from noloco_jax.outer import base, compression, coset, exchange, methods, pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from tests.test_compression import assert_one_line_config_error

N = 8


# ---- NumPy references, from the definitions in coset.py's docstring (float32 where the code is) ----


def np_encode(x, eps, u, bits):
  k = np.round(np.float32(x) / np.float32(eps) + u)
  return np.mod(k, 2 ** bits).astype(np.uint8)


def np_decode(codes, side, eps, u, bits):
  levels = np.float32(2.0 ** bits)
  code = codes.astype(np.float32)
  y = side / np.float32(eps) + u
  k_hat = code + levels * np.round((y - code) / levels)
  return (k_hat - u) * np.float32(eps)


def _pair(seed, n=4096, spread=0.01):
  rng = np.random.default_rng(seed)
  ci = rng.normal(size=n).astype(np.float32) * 0.05
  cj = (ci + spread * rng.standard_t(5, size=n)).astype(np.float32)  # heavy-tailed differences, as measured
  u = rng.uniform(-0.5, 0.5, size=n).astype(np.float32)
  return ci, cj, u


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_coset_codes_and_decode_match_numpy_bitwise(bits):
  ci, cj, u = _pair(bits)
  eps = np.float32(0.013)
  codes = np.asarray(jax.jit(coset.coset_encode, static_argnums=3)(cj, eps, u, bits))
  np.testing.assert_array_equal(codes, np_encode(cj, eps, u, bits))
  got = np.asarray(jax.jit(coset.coset_decode, static_argnums=4)(codes, ci, eps, u, bits))
  np.testing.assert_array_equal(got, np_decode(codes, ci, eps, u, bits))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_decode_is_exact_up_to_the_dither_inside_the_range_and_bounded_outside(bits):
  """|D|/ε < 2^(b−1) − ½: ĉ − c = (round(c/ε + u) − c/ε − u)·ε, within ε/2 (+ float32 round-off of the
  arithmetic on values of size |c|). Outside: the decoded difference stays within ±(2^(b−1) + ½)·ε of c_i."""
  ci, cj, u = _pair(10 + bits, spread=0.02)
  eps = np.float32(0.01)
  got = np_decode(np_encode(cj, eps, u, bits), ci, eps, u, bits)
  inside = np.abs(cj - ci) / eps < 2 ** (bits - 1) - 0.5 - 1e-3
  assert inside.mean() > 0.5 and (~inside).any()
  roundoff = 4 * np.finfo(np.float32).eps * (np.abs(cj) / eps + 2 ** bits) * eps
  err = got - cj
  assert (np.abs(err[inside]) <= eps / 2 + roundoff[inside]).all()
  want = (np.round(cj.astype(np.float64) / eps + u) - cj.astype(np.float64) / eps - u) * eps
  np.testing.assert_allclose(err[inside], want[inside], atol=roundoff.max())
  assert (np.abs(got - ci) <= (2 ** (bits - 1) + 0.5) * eps + roundoff).all()


def test_dithered_error_is_unbiased_with_variance_eps2_over_12():
  """Subtractive dither: inside the range the error is uniform on [−ε/2, ε/2), whatever c is (the
  statistics of 200,000 draws: mean within 4 standard errors of 0, variance within 4 of ε²/12)."""
  rng = np.random.default_rng(0)
  n, eps, bits = 200_000, np.float32(0.01), 3
  ci = np.full(n, 0.1234, np.float32)
  cj = (ci + 0.004).astype(np.float32)  # one fixed difference: without dither the error would be constant
  u = jax.random.uniform(jax.random.PRNGKey(0), (n,), jnp.float32, -0.5, 0.5)
  err = np.asarray(coset.coset_decode(coset.coset_encode(cj, eps, u, bits), ci, eps, u, bits)).astype(np.float64) - cj
  var = eps.astype(np.float64) ** 2 / 12
  assert abs(err.mean()) < 4 * math.sqrt(var / n)
  assert abs(err.var() - var) < 4 * var * math.sqrt(0.8 / n)  # var of U² is (4/5)·var²
  assert np.abs(err).max() <= eps / 2 + 1e-7


def test_dither_is_uniform_and_shared():
  u = np.asarray(coset.dither(jax.random.PRNGKey(3), 2, 7, (50_000,)))
  assert (u >= -0.5).all() and (u < 0.5).all()
  counts = np.histogram(u, bins=20, range=(-0.5, 0.5))[0]
  chi2 = ((counts - 2500) ** 2 / 2500).sum()
  assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001
  np.testing.assert_array_equal(u, np.asarray(coset.dither(jax.random.PRNGKey(3), 2, 7, (50_000,))))
  assert not np.array_equal(u, np.asarray(coset.dither(jax.random.PRNGKey(3), 2, 8, (50_000,))))


def test_cyclic_fragments_cover_every_block_once_per_cycle():
  key, num, m = jax.random.PRNGKey(1), 40, 8
  seen = np.concatenate([np.asarray(coset.fragment_index(key, 0, r, num, m, "cyclic")) for r in range(5)])
  np.testing.assert_array_equal(np.sort(seen), np.arange(num))
  again = np.concatenate([np.asarray(coset.fragment_index(key, 0, r, num, m, "cyclic")) for r in range(5, 10)])
  np.testing.assert_array_equal(np.sort(again), np.arange(num))


def test_fixed_fragments_are_the_same_every_round_and_a_uniform_subset_per_leaf():
  key, num, m = jax.random.PRNGKey(1), 40, 8
  first = np.asarray(coset.fragment_index(key, 3, 0, num, m, "fixed"))
  for r in (1, 7, 100):
    np.testing.assert_array_equal(np.asarray(coset.fragment_index(key, 3, r, num, m, "fixed")), first)
  assert len(set(first)) == m
  # Over leaves (independent keys), each block is chosen with probability m/num (chi-square, 2,000 leaves).
  picks = np.asarray(jax.jit(jax.vmap(lambda leaf: coset.fragment_index(key, leaf, 0, num, m, "fixed")))(jnp.arange(2000)))
  counts = np.bincount(picks.ravel(), minlength=num)
  expected = 2000 * m / num
  assert ((counts - expected) ** 2 / expected).sum() < 73.4  # 39 degrees of freedom, p = 0.001


def test_random_fragments_are_uniform_subsets():
  """Each block is in round r's subset with probability m/num (a chi-square over 2,000 rounds), no repeats."""
  key, num, m, rounds = jax.random.PRNGKey(2), 12, 3, 2000
  draw = jax.jit(jax.vmap(lambda r: coset.fragment_index(key, 1, r, num, m, "random")))
  picks = np.asarray(draw(jnp.arange(rounds)))
  assert all(len(set(row)) == m for row in picks)
  counts = np.bincount(picks.ravel(), minlength=num)
  expected = rounds * m / num
  assert ((counts - expected) ** 2 / expected).sum() < 31.3  # 11 degrees of freedom, p = 0.001


# ---- A whole round against NumPy ----


RULE = ("outer_momentum", "outer_lr", "consensus_weight", "group_size")


def _outer_cfg(**kw):
  """config.outer with `kw` set: the rule's fields (RULE) in outer.rule, coset_* and compression in
  outer.codec, the rest (inner_steps) in outer."""
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  for name, value in kw.items():
    section = cfg.rule if name in RULE else cfg.codec if name.startswith("coset") or name == "compression" else cfg
    section[name] = value
  return cfg


def _make(cfg, seed=0):
  """The method and its codec (outer.codec.coset_seed = seed)."""
  cfg.codec.coset_seed = seed
  o = OuterConfig.parse(cfg)
  return methods.make(cfg), base.make_codec(o.codec, inner_steps=o.inner_steps, beta=o.rule.outer_lr)


def _replicas(seed):
  rng = np.random.default_rng(seed)
  shapes = {"w": (40, 30), "b": (5,)}
  phi0 = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  phi = {k: (v + 0.01 * rng.normal(size=(N,) + v.shape)).astype(np.float32) for k, v in phi0.items()}
  theta = {k: (v + 0.003 * rng.normal(size=v.shape)).astype(np.float32) for k, v in phi.items()}
  delta = {k: (0.001 * rng.normal(size=v.shape)).astype(np.float32) for k, v in phi.items()}
  return theta, phi, delta


def np_lattice_steps(codec, theta, phi, h, *, beta, gamma):
  """ε = 2^e per leaf and replica (float64): e = round(log2(κ·√max(h, 2·ms(β·(θ − φ))))), at least
  floor(log2(max|c|)) − 20."""
  kappa = codec.kappa or coset.DEFAULT_KAPPA[codec.bits]
  fallback = 2 * (codec.group if codec.mode == "sum" else 1)  # a signed sum of g values: g times the variance
  out = []
  for leaf, k in enumerate(sorted(theta)):
    t, p = theta[k].astype(np.float64), phi[k].astype(np.float64)
    s2 = [max(h[leaf][j], fallback * np.mean((beta * (t[j] - p[j])) ** 2)) for j in range(N)]
    # (the floor, floor(log2(max|c|)) − 20, is far below these steps here)
    out.append(np.array([2.0 ** round(math.log2(kappa * math.sqrt(s2[j]))) for j in range(N)]))
  return out


def np_tree_sum(x):
  while x.shape[-1] > 1:
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def np_fragment(codec, leaf, round_, num, m, nu=None, width=None):
  """The fragment's blocks: the shared schedule, or the sender's top-m by mean ν (descending, as top_k)."""
  if codec.order in ("cyclic", "random"):
    return np.asarray(coset.fragment_index(codec.key, leaf, round_, num, m, codec.order))
  score = np.concatenate([nu.ravel(), np.zeros(num * width - nu.size, np.float32)]).reshape(num, width).mean(-1)
  return np.argsort(-score, kind="stable")[:m]


def np_received(codec, c_partner, c_own, eps_partner, round_, nu_partner, s2_partner):
  """The partner's message (lists of float32 leaves) as the receiver decodes it, mode by mode."""
  if codec.mode == "global":
    B = codec.block
    cut = lambda x: np.concatenate([x.ravel(), np.zeros(-x.size % B, np.float32)]).reshape(-1, B)
    leaf_of = np.concatenate([np.full(-(-x.size // B), i) for i, x in enumerate(c_own)])
    own, partner = np.concatenate([cut(x) for x in c_own]), np.concatenate([cut(x) for x in c_partner])
    score = np.concatenate([cut(x) for x in nu_partner]).mean(-1) * np.asarray(s2_partner)[leaf_of]
    m = coset.fragment_count(own.shape[0], codec.density)
    idx = np.argsort(-score, kind="stable")[:m]
    e = np.float32(np.asarray(eps_partner)[leaf_of[idx]])[:, None]
    u = np.asarray(coset.dither(codec.key, 0, round_, (m, B)))
    own[idx] = np_decode(np_encode(partner[idx], e, u, codec.bits), own[idx], e, u, codec.bits)
    out, start = [], 0
    for x in c_own:
      count = -(-x.size // B)
      out.append(own[start:start + count].ravel()[:x.size].reshape(x.shape))
      start += count
    return out
  out = []
  for leaf, (cp, co, e) in enumerate(zip(c_partner, c_own, eps_partner)):
    e = np.float32(e)
    if codec.mode == "sum":
      g = codec.group
      grp = lambda x: np.concatenate([x.ravel(), np.zeros(-x.size % g, np.float32)]).reshape(-1, g)
      sg = np.asarray(coset.signs(codec.key, leaf, round_, grp(co).shape))
      t_own, t_partner = np_tree_sum(sg * grp(co)), np_tree_sum(sg * grp(cp))
      u = np.asarray(coset.dither(codec.key, leaf, round_, t_own.shape))
      t_hat = np_decode(np_encode(t_partner, e, u, codec.bits), t_own, e, u, codec.bits)
      moved = grp(co) + sg * ((t_hat - t_own) / np.float32(g))[:, None]
      out.append(moved.ravel()[:co.size].reshape(co.shape))
      continue
    n = co.size
    num, width = compression.chunk_shape(n, codec.block)
    m = coset.fragment_count(num, codec.density)
    idx = np_fragment(codec, leaf, round_, num, m, None if nu_partner is None else nu_partner[leaf], width)
    cut = lambda x: np.concatenate([x.ravel(), np.zeros(num * width - n, np.float32)]).reshape(num, width)
    own, partner = cut(co), cut(cp)
    u = np.asarray(coset.dither(codec.key, leaf, round_, (m, width)))
    own[idx] = np_decode(np_encode(partner[idx], e, u, codec.bits), own[idx], e, u, codec.bits)
    out.append(own.ravel()[:n].reshape(co.shape))
  return out


def np_coded_ms(codec, sum_sq, moved_blocks, n):
  """The codec's estimate of ms(D) of the coded values from Σ(2·(mean − own))² (coset.py: _coded_ms)."""
  if codec.mode == "global":
    return sum_sq / max(min(moved_blocks * codec.block, n), 1)
  if codec.mode == "sum":
    g = codec.group
    return sum_sq * g * g / (-(-n // g) * g)
  num, width = compression.chunk_shape(n, codec.block)
  return sum_sq / min(coset.fragment_count(num, codec.density) * width, n)


def np_coset_round(codec, theta, phi, delta, h, eps, nu, groups, step, *, alpha, beta, gamma):
  """One NoLoCo round with coset messages: c in float32 as exchange.message, the codes and decode in
  float32 as defined, the update in float64. The fragments, signs and dither come from the codec's key
  (NumPy cannot draw JAX's streams), and ε from the run (checked against np_lattice_steps separately:
  a value on a rounding boundary would otherwise flip a code). Returns θ, δ and the new h per leaf."""
  round_ = step // codec.inner_steps
  keys = sorted(theta)  # the tree's leaf order
  c = [np.float32(beta) * theta[k] + np.float32(gamma - beta) * phi[k] for k in keys]
  fresh = [beta * (theta[k].astype(np.float64) - phi[k]) for k in keys]
  fallback = 2 * (codec.group if codec.mode == "sum" else 1)
  s2 = [[max(h[leaf][j], fallback * np.mean(fresh[leaf][j] ** 2)) for leaf in range(len(keys))] for j in range(N)]
  out = {"theta": {k: np.empty(theta[k].shape) for k in keys}, "delta": {k: np.empty(theta[k].shape) for k in keys},
         "h": [np.empty(N) for _ in keys]}
  for i in range(N):
    j = next(b for g in groups if i in g for b in g if b != i)
    received = np_received(codec, [x[j] for x in c], [x[i] for x in c], [e[j] for e in eps], round_,
                           None if nu is None else [nu[k][j] for k in keys], s2[j])
    for leaf, k in enumerate(keys):
      mean_c = (c[leaf][i].astype(np.float64) + received[leaf]) / 2
      out["delta"][k][i] = alpha * delta[k][i] + mean_c - gamma * phi[k][i]
      out["theta"][k][i] = phi[k][i] + out["delta"][k][i]
      diff = 2 * (mean_c - c[leaf][i])
      cut = np.concatenate([diff.ravel(), np.zeros(-diff.size % codec.block)]).reshape(-1, codec.block)
      moved = int((np.abs(cut).sum(-1) > 0).sum())
      ms = max(np_coded_ms(codec, np.sum(diff ** 2), moved, diff.size) - np.float64(eps[leaf][i]) ** 2 / 12, 0.0)
      if codec.mode == "global" and moved == 0:
        out["h"][leaf][i] = h[leaf][i]
      else:
        out["h"][leaf][i] = ms if h[leaf][i] <= 0 else codec.memory * h[leaf][i] + (1 - codec.memory) * ms
  return out


def _round(method, pool, index, theta, outer, step, num_devices=N, opt_state=()):
  mesh = mesh_lib.make_mesh(N, num_devices)
  state = TrainState(step=np.full(N, step, np.int32), params=theta, opt_state=opt_state, outer=outer)
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  route = jnp.asarray(index) if isinstance(index, np.ndarray) else jnp.int32(index)
  new_state, _ = programs_lib.make_round_fn(method, mesh, pool)(state, route)
  return jax.tree.map(np.asarray, new_state)


def _adam_state(theta, seed):
  """An inner Adam state per replica whose second moment ν is random (what fisher / global read)."""
  import optax
  rng = np.random.default_rng(seed)
  nu = {k: rng.gamma(0.5, size=v.shape).astype(np.float32) for k, v in theta.items()}
  state = jax.vmap(optax.adam(1e-3).init)(theta)
  return (state[0]._replace(nu=nu),) + tuple(state[1:]), nu


@pytest.mark.parametrize("mode,bits,density,order,h0", [
    ("fragment", 2, 0.3, "cyclic", 0.0), ("fragment", 3, 0.5, "random", 2e-4), ("fragment", 4, 1.0, "cyclic", 1e-5),
    ("fragment", 2, 0.3, "fisher", 1e-4), ("sum", 2, 0.25, "cyclic", 0.0), ("global", 2, 0.3, "cyclic", 1e-4)])
def test_coset_round_matches_numpy(mode, bits, density, order, h0):
  theta, phi, delta = _replicas(bits)
  cfg = _outer_cfg(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9, inner_steps=5, compression="coset",
                   coset_bits=bits, coset_density=density, coset_block=64, coset_order=order, coset_mode=mode)
  method, codec = _make(cfg, seed=11)
  h = [np.full(N, h0, np.float32) for _ in theta]  # leaves in tree order: b, w
  outer = {"slow": phi, "momentum": delta, "codec": {"h": h, "eps": [np.zeros(N, np.float32) for _ in theta]}}
  informed = order == "fisher" or mode == "global"
  opt_state, nu = _adam_state(theta, bits) if informed else ((), None)
  groups = pairing.groups_from_permutation(np.random.default_rng(1).permutation(N), 2)
  step = 15  # round 3
  got = _round(method, (groups,), 0, theta, outer, step, opt_state=opt_state)
  eps = got.outer["codec"]["eps"]
  for got_eps, want_eps in zip(eps, np_lattice_steps(codec, theta, phi, h, beta=0.7, gamma=0.9)):
    np.testing.assert_array_equal(got_eps, want_eps)
  want = np_coset_round(codec, theta, phi, delta, h, eps, nu, groups, step, alpha=0.5, beta=0.7, gamma=0.9)
  for k in theta:
    np.testing.assert_allclose(got.params[k], want["theta"][k], atol=2e-6)
    np.testing.assert_allclose(got.outer["momentum"][k], want["delta"][k], atol=2e-6)
  for got_h, want_h, e in zip(got.outer["codec"]["h"], want["h"], eps):
    # h = (a float32 sum of squares) − ε²/12: round-off of the larger of the two terms, which may cancel.
    scale = np.maximum(want_h, 0) + np.asarray(e, np.float64) ** 2 / 12
    np.testing.assert_allclose(got_h, want_h, rtol=0, atol=float(1e-5 * scale.max()))


@pytest.mark.parametrize("bits,kappa", [(4, 1.0)])
def test_coset_round_with_a_step_per_block_matches_numpy(bits, kappa):
  """coset_scale='block': ε = 2^e per block of the fragment, e = round(log2(κ·√max(hb, 2·ms(β·(θ − φ)) of
  the block))); the receiver decodes each block with its own ε; hb ← memory·hb + (1 − memory)·(ms of the
  block's decoded difference − eb²/12) on the blocks that moved (the first observation as it is)."""
  theta, phi, delta = _replicas(bits + 20)
  cfg = _outer_cfg(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9, inner_steps=5, compression="coset",
                   coset_bits=bits, coset_density=0.3, coset_block=64, coset_kappa=kappa, coset_scale="block")
  method, codec = _make(cfg, seed=5)
  keys = sorted(theta)
  rng = np.random.default_rng(bits)
  nums = [compression.chunk_shape(theta[k][0].size, 64)[0] for k in keys]
  # Some blocks with an estimate (from earlier rounds), some without (h = 0: the fallback sets their step).
  hb = [(rng.uniform(0, 4e-4, (N, n)) * (rng.uniform(size=(N, n)) < 0.5)).astype(np.float32) for n in nums]
  zeros = lambda: [np.zeros(N, np.float32) for _ in keys]
  codec_state = {"h": zeros(), "eps": zeros(), "hb": hb, "eb": [np.zeros((N, n), np.float32) for n in nums]}
  outer = {"slow": phi, "momentum": delta, "codec": codec_state}
  groups = pairing.groups_from_permutation(np.random.default_rng(3).permutation(N), 2)
  step = 20  # round 4
  round_ = step // 5
  got = _round(method, (groups,), 0, theta, outer, step)
  c = [np.float32(0.7) * theta[k] + np.float32(0.9 - 0.7) * phi[k] for k in keys]
  fresh = [0.7 * (theta[k].astype(np.float64) - phi[k]) for k in keys]
  for leaf, k in enumerate(keys):
    n = theta[k][0].size
    num, width = compression.chunk_shape(n, 64)
    m = coset.fragment_count(num, 0.3)
    idx = np.asarray(coset.fragment_index(codec.key, leaf, round_, num, m, "cyclic"))
    cut = lambda x: np.concatenate([x.ravel(), np.zeros(num * width - n, x.dtype)]).reshape(num, width)
    # Each replica's steps on its fragment's blocks (float64 from float32 inputs; no value sits on a boundary).
    eb = np.array(hb[leaf])
    for j in range(N):
      s2 = np.maximum(hb[leaf][j][idx], 2 * np.mean(cut(fresh[leaf][j])[idx] ** 2, axis=-1))
      eb[j, idx] = 2.0 ** np.round(np.log2(kappa * np.sqrt(s2)))
    eb[:, np.setdiff1d(np.arange(num), idx)] = 0.0  # eb: this replica's last step per block (0: none yet)
    np.testing.assert_array_equal(got.outer["codec"]["eb"][leaf][:, idx], eb[:, idx])
    u = np.asarray(coset.dither(codec.key, leaf, round_, (m, width)))
    for i in range(N):
      j = next(b for g in groups if i in g for b in g if b != i)
      own, partner = cut(c[leaf][i]), cut(c[leaf][j])
      e = np.float32(eb[j, idx])[:, None]
      own[idx] = np_decode(np_encode(partner[idx], e, u, bits), own[idx], e, u, bits)
      received = own.ravel()[:n].reshape(c[leaf][i].shape)
      mean_c = (c[leaf][i].astype(np.float64) + received) / 2
      want_delta = 0.5 * delta[k][i] + mean_c - 0.9 * phi[k][i]
      np.testing.assert_allclose(got.outer["momentum"][k][i], want_delta, atol=2e-6)
      np.testing.assert_allclose(got.params[k][i], phi[k][i] + want_delta, atol=2e-6)
      sq = cut(2 * (mean_c - c[leaf][i])) ** 2
      moved = sq.sum(-1) > 0
      ms = np.maximum(sq.mean(-1) - np.float64(eb[i]) ** 2 / 12, 0.0)
      h0 = np.float64(hb[leaf][i])
      want_hb = np.where(moved, np.where(h0 > 0, 0.5 * h0 + 0.5 * ms, ms), h0)
      assert moved.sum() == len(idx)  # the fragment's blocks, and only they, moved
      scale = want_hb + np.float64(eb[i]) ** 2 / 12
      np.testing.assert_allclose(got.outer["codec"]["hb"][leaf][i], want_hb, rtol=0, atol=float(1e-5 * scale.max()))


def test_off_the_fragment_a_round_is_a_local_outer_step():
  """Where nothing was sent, δ ← α·δ + β·(θ − φ) exactly (the partner's value is taken to be one's own)."""
  theta, phi, delta = _replicas(4)
  cfg = _outer_cfg(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.7, inner_steps=5, compression="coset",
                   coset_bits=2, coset_density=0.1, coset_block=64)
  method, _ = _make(cfg)
  outer = {"slow": phi, "momentum": delta, "codec": {"h": [np.zeros(N, np.float32)] * 2, "eps": [np.zeros(N, np.float32)] * 2}}
  groups = pairing.groups_from_permutation(np.arange(N), 2)
  got = _round(method, (groups,), 0, theta, outer, 5)
  local = {k: 0.5 * delta[k].astype(np.float64) + 0.7 * (theta[k].astype(np.float64) - phi[k]) for k in theta}
  same = np.isclose(got.outer["momentum"]["w"], local["w"], atol=1e-7, rtol=0)
  assert 0.75 < same.mean() < 1.0  # 2 of 19 blocks of 64 were sent (the rest: exactly the local step)


@pytest.mark.parametrize("rest,order", [("keep", "cyclic"), ("anchor", "cyclic"), ("anchor", "random")])
def test_off_the_fragment_rule_matches_numpy(rest, order):
  """coset_rest: on the round's fragment the round's rule (np_coset_round), off it `keep` leaves θ as trained
  and sets φ ← θ, `anchor` leaves θ and φ as they were; δ stays as it was off the fragment in both."""
  theta, phi, delta = _replicas(7)
  cfg = _outer_cfg(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9, inner_steps=5, compression="coset",
                   coset_bits=2, coset_density=0.3, coset_block=64, coset_order=order, coset_rest=rest)
  method, codec = _make(cfg, seed=3)
  h = [np.full(N, 1e-4, np.float32) for _ in theta]
  outer = {"slow": phi, "momentum": delta, "codec": {"h": h, "eps": [np.zeros(N, np.float32) for _ in theta]}}
  groups = pairing.groups_from_permutation(np.random.default_rng(2).permutation(N), 2)
  step = 25  # round 5
  got = _round(method, (groups,), 0, theta, outer, step)
  eps = got.outer["codec"]["eps"]
  want = np_coset_round(codec, theta, phi, delta, h, eps, None, groups, step, alpha=0.5, beta=0.7, gamma=0.9)
  for leaf, k in enumerate(sorted(theta)):
    n = theta[k][0].size
    num, width = compression.chunk_shape(n, 64)
    idx = np_fragment(codec, leaf, step // 5, num, coset.fragment_count(num, 0.3))
    on = np.zeros((num, width), bool)
    on[idx] = True
    on = on.ravel()[:n].reshape(theta[k][0].shape)
    assert 0 < on.mean() < 1 or k == "b"  # b: 5 values, one block (always sent); w: 19 blocks, 6 sent
    want_theta = np.where(on, want["theta"][k], theta[k])
    want_phi = np.where(on, want["theta"][k], theta[k] if rest == "keep" else phi[k])
    want_delta = np.where(on, want["delta"][k], delta[k])
    np.testing.assert_allclose(got.params[k], want_theta, atol=2e-6)
    np.testing.assert_allclose(got.outer["slow"][k], want_phi, atol=2e-6)
    np.testing.assert_allclose(got.outer["momentum"][k], want_delta, atol=2e-6)
    # Off the fragment the values are the old ones, bit for bit.
    np.testing.assert_array_equal(got.params[k][:, ~on], theta[k][:, ~on])
    np.testing.assert_array_equal(got.outer["slow"][k][:, ~on], (theta if rest == "keep" else phi)[k][:, ~on])
    np.testing.assert_array_equal(got.outer["momentum"][k][:, ~on], delta[k][:, ~on])


@pytest.mark.parametrize("num_devices", [1])
def test_coset_mesh_and_simulator_agree_bitwise(num_devices):
  theta, phi, delta = _replicas(5)
  method, _ = _make(_outer_cfg(compression="coset", coset_bits=2, coset_density=0.3, coset_block=64), seed=2)
  outer = {"slow": phi, "momentum": delta, "codec": {"h": [np.full(N, 1e-4, np.float32)] * 2,
                                                      "eps": [np.zeros(N, np.float32)] * 2}}
  schedule = pairing.PairingSchedule(seed=3, num_replicas=N, group_size=2, mode="round_robin")
  a = _round(method, schedule.pool, schedule.index(5), theta, outer, 50)
  b = _round(method, schedule.pool, schedule.index(5), theta, outer, 50, num_devices=num_devices)
  for x, y in zip(jax.tree.leaves((a.params, a.outer["slow"], a.outer["momentum"], a.outer["codec"]["eps"])),
                  jax.tree.leaves((b.params, b.outer["slow"], b.outer["momentum"], b.outer["codec"]["eps"]))):
    np.testing.assert_array_equal(x, y)
  # h is a sum over a leaf, which two programs may reduce in different orders: equal to float32 round-off.
  for x, y in zip(a.outer["codec"]["h"], b.outer["codec"]["h"]):
    np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("mode,order,bits,density", [
    ("fragment", "cyclic", 2, 0.3), ("fragment", "cyclic", 32, 0.02), ("fragment", "fisher", 2, 0.3),
    ("sum", "cyclic", 2, 0.25), ("global", "cyclic", 2, 0.3)])
def test_coset_bytes_match_the_compiled_collectives(mode, order, bits, density):
  theta = {"w": np.zeros((N, 96, 128), np.float32), "b": np.zeros((N, 5), np.float32)}
  method, _ = _make(_outer_cfg(compression="coset", coset_bits=bits, coset_density=density, coset_mode=mode,
                               coset_order=order))
  opt_state, _ = _adam_state(theta, 0)
  mesh = mesh_lib.make_mesh(N, N)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=opt_state,
                                     outer=jax.vmap(method.init)(theta)), mesh_lib.replica_sharding(mesh))
  groups = pairing.groups_from_permutation(np.arange(N), 2)
  hlo = programs_lib.make_round_fn(method, mesh, (groups,)).lower(state, jnp.int32(0)).compile().as_text()
  counted = method.traffic(jax.tree.map(lambda x: x[0], theta), N)[0].operand
  assert hlo_lib.collective_bytes(hlo, "collective-permute") == counted
  # w: 12,288 values, 48 blocks of 256; b: 5 values (one block of 8; `global`: of 256). Plus the round (int32).
  codes = lambda values: -(-values * bits // 8)
  if mode == "sum":  # one b-bit sum per 4 values (+ ε's int8 exponent per leaf); b: 2 sums, packed to 8 codes
    want = codes(12288 // 4) + 1 + codes(8) + 1
  elif mode == "global":  # 49 blocks, m = ceil(0.3 · 49) of them: codes, a uint16 index and an exponent each
    m = math.ceil(density * 49)
    want = codes(m * 256) + 2 * m + m
  else:  # per leaf: m blocks' codes (+ the exponent; fisher: a uint16 index per block)
    m = math.ceil(density * 48)
    per_leaf = (1 if bits < 16 else 0) + (2 * m if order == "fisher" else 0)
    want = codes(m * 256) + per_leaf + codes(8) + (1 if bits < 16 else 0) + (2 if order == "fisher" else 0)
  assert counted == want + 4


@pytest.mark.parametrize("overrides,field", [
    ({"outer.codec.compression": "coset", "outer.codec.coset_density": 0.0}, "outer.codec.coset_density"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_density": 1.2}, "outer.codec.coset_density"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_bits": 1}, "outer.codec.coset_bits"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_order": "sorted"}, "outer.codec.coset_order"),
    ({"outer.codec.compression": "coset", "outer.rule.group_size": 4}, "outer.rule.group_size"),
    ({"outer.codec.compression": "coset", "outer.overlap.steps": 1}, "outer.overlap.steps"),
    ({"outer.codec.compression": "coset", "outer.schedule": "async"}, "outer.schedule"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_scale": "block", "outer.codec.coset_mode": "sum",
      "outer.codec.coset_density": 0.5}, "outer.codec.coset_scale"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_mode": "sum", "outer.codec.coset_density": 0.3}, "outer.codec.coset_density"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_mode": "global", "outer.codec.coset_bits": 32}, "outer.codec.coset_bits"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_mode": "tree"}, "outer.codec.coset_mode"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_rest": "none"}, "outer.codec.coset_rest"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_rest": "keep", "outer.codec.coset_mode": "sum",
      "outer.codec.coset_density": 0.5}, "outer.codec.coset_rest"),
    ({"outer.codec.compression": "coset", "outer.codec.coset_rest": "anchor", "outer.codec.coset_order": "fisher"},
     "outer.codec.coset_rest"),
])
def test_bad_coset_settings_name_the_field(overrides, field):
  assert_one_line_config_error(overrides, field)


# ---- The spread: the coded second-moment recursion (outer/stability.py) against a Monte-Carlo ----


@pytest.mark.parametrize("coverage_blocks,kappa", [(3, 2.0), (8, 2.0), (2, 0.0)])
def test_coded_spread_matches_the_second_moment_recursion(coverage_blocks, kappa):
  """192 independent runs of 8 replicas × 64 values (8 blocks of 8), 10 rounds: fresh pairs, a random
  fragment of `coverage_blocks` blocks per round (coset.fragment_index), the partner's message decoded by
  coset_encode / coset_decode at ε = κ·rms(D) (b = 8: no wraps; κ = 0: exact values), methods/noloco.update.
  The sample second moments match the exact coded recursion (test_stability.coded_second_moments) within 4
  standard errors."""
  from noloco_jax.outer.methods import noloco
  from tests.test_stability import coded_second_moments
  alpha, beta, gamma, sigma2, rounds, trials, blocks, width = 0.5, 0.7, 0.7, 1.0, 10, 192, 8, 8
  p = coverage_blocks / blocks
  exact = coded_second_moments(rounds, np.zeros((2, 2)), alpha=alpha, beta=beta, gamma=gamma, num_replicas=N,
                                         coverage=p, relative_noise=kappa ** 2 / 12, noise_var=sigma2)
  rng = np.random.default_rng(0)
  phi = np.zeros((trials, N, blocks * width), np.float32)
  delta = np.zeros_like(phi)
  est = []
  key = jax.random.PRNGKey(5)
  for t in range(rounds):
    theta = phi + np.sqrt(sigma2) * rng.normal(size=phi.shape).astype(np.float32)
    c = np.asarray(exchange.message(theta, phi, beta=beta, gamma=gamma))
    partner = np.empty((trials, N), int)
    for trial in range(trials):
      groups = pairing.PairingSchedule(seed=trial, num_replicas=N, group_size=2).groups(t)
      for a, b in groups:
        partner[trial, a], partner[trial, b] = b, a
    c_partner = np.take_along_axis(c, partner[:, :, None], axis=1)
    ed2 = 2 * (gamma ** 2 * exact[t, 0, 0] + beta ** 2 * sigma2)  # E[D²] at this round (oracle step)
    if kappa:
      eps = np.float32(kappa * np.sqrt(ed2))
      u = np.asarray(jax.random.uniform(jax.random.fold_in(key, t), c.shape, jnp.float32, -0.5, 0.5))
      decoded = np.asarray(coset.coset_decode(coset.coset_encode(c_partner, eps, u, 8), c, eps, u, 8))
    else:
      decoded = c_partner
    # Each run its own fragments (the `leaf` slot of the key takes the run's index): the recursion is the
    # expectation over fragment draws too.
    chosen = np.asarray(jax.vmap(lambda r: coset.fragment_index(key, r, t, blocks, coverage_blocks, "random"))(
        jnp.arange(trials)))
    mask = np.zeros((trials, blocks), bool)
    np.put_along_axis(mask, chosen, True, axis=1)
    mask = np.repeat(mask, width, axis=1)[:, None, :]
    mean_c = np.where(mask, (c + decoded) / 2, c)
    phi, delta = (np.asarray(x) for x in noloco.update(phi, delta, mean_c, alpha=alpha, gamma=gamma))
    x = phi.astype(np.float64) - phi.mean(axis=1, keepdims=True)
    y = delta.astype(np.float64) - delta.mean(axis=1, keepdims=True)
    scale = 1.0 / ((N - 1) * phi.shape[-1])
    est.append(np.stack([(x * x).sum((1, 2)) * scale, (x * y).sum((1, 2)) * scale, (y * y).sum((1, 2)) * scale]))
  for t in (1, 3, rounds):
    for j, (a, b) in enumerate([(0, 0), (0, 1), (1, 1)]):
      sample = est[t - 1][j]
      se = sample.std(ddof=1) / np.sqrt(trials)
      assert abs(sample.mean() - exact[t, a, b]) <= 4 * se, (t, (a, b), sample.mean(), exact[t, a, b], se)


# ---- experiments/bench_compression.py: its training part, quick (the smoke job, one seed) ----


def test_bench_compression_trains_each_setting_and_reports_loss_and_bytes_against_float32(tmp_path):
  """--train --quick: float32 and the coset codec at 30 % on the smoke job. vs_float32 is the counted
  bytes over float32's, and every run sent exactly the counted bytes per round (its comm metric); the
  means are over the seeds; --merge joins another seed's runs (the means kept here: the same values) and takes
  a run found in two parts (the same setting and seed) once."""
  from experiments import bench_compression as bench
  result = bench.main(["--train", "--quick"])
  by_name = {s["setting"]: s for s in result["settings"]}
  assert list(by_name) == ["float32", "coset 30% 2-bit"]
  f32, coded = by_name["float32"], by_name["coset 30% 2-bit"]
  assert f32["vs_float32"] == 1 and f32["loss_vs_float32"] == 1
  assert f32["bytes_per_round"] == 4 * f32["params"]
  assert 0 < coded["vs_float32"] < 0.03  # 2 bits on 30 % of the values, plus exponents and the round
  assert coded["loss_vs_float32"] == coded["eval_loss"] / f32["eval_loss"]
  for s in result["settings"]:
    (row,) = s["seeds"]
    assert row["bytes_sent_per_round"] == s["bytes_per_round"] and row["error"] is None
    assert s["eval_loss"] == row["eval_loss"] and np.isfinite(row["eval_loss"])
  json = __import__("json")
  path, other = tmp_path / "one.json", tmp_path / "other.json"
  path.write_text(json.dumps(result))
  other.write_text(json.dumps({**result, "settings": [{**s, "seeds": [{**s["seeds"][0], "seed": 7}]}
                                                      for s in result["settings"]]}))
  merged = bench.main([f"--merge={path},{other},{path}"])
  for a, b in zip(merged["settings"], result["settings"]):
    assert [r["seed"] for r in a["seeds"]] == [0, 7]
    assert a["eval_loss"] == pytest.approx(b["eval_loss"]) and a["vs_float32"] == b["vs_float32"]


def test_bench_compression_trains_a_larger_model_with_preset(tmp_path, capsys):
  """--train --preset 1m: the same (here smoke) job with bench_network's 5-layer model, named in the result's
  job, which --merge does not join with the tiny model's; a model.preset clears the job's size overrides; an
  unknown preset is one line naming the flag, the value and the valid ones (exit 2)."""
  from experiments import bench_compression as bench
  result = bench.main(["--train", "--quick", "--preset", "1m", "--settings", "float32", "--seeds", "0"])
  (f32,) = result["settings"]
  assert result["job"] == "smoke, model 1m"
  assert f32["params"] == 1_132_160 and f32["bytes_per_round"] == 4 * f32["params"]  # 5 layers of width 128
  assert np.isfinite(f32["eval_loss"]) and f32["seeds"][0]["error"] is None
  json = __import__("json")
  big, tiny = tmp_path / "big.json", tmp_path / "tiny.json"
  big.write_text(json.dumps(result))
  tiny.write_text(json.dumps({**result, "job": "smoke"}))
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    bench.main([f"--merge={big},{tiny}"])
  assert e.value.code == 2 and capsys.readouterr().err.strip() == "noloco_jax: --merge: the results are of different jobs"
  config = default.get_config("smoke")
  bench.set_model(config, "small")
  assert config.model.preset == "small" and config.model.d_model == config.model.num_layers == 0
  with pytest.raises(SystemExit) as e:
    bench.main(["--train", "--quick", "--preset", "nope"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err == ["noloco_jax: --preset='nope' is not a model: one of tiny, small, medium, large, 1m"]
