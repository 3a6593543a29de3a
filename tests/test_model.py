"""Model: shapes, causality, parameter counts against the analytic formula and docs/method.md §10."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.models import llama as model_lib


def _tiny(**overrides):
  cfg = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_seq_len=16)
  cfg.update(overrides)
  return model_lib.LlamaConfig(**cfg)


def _init(cfg, L=16):
  model = model_lib.Llama(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"]
  return model, params


def test_logits_shape_and_dtype():
  cfg = _tiny()
  model, params = _init(cfg)
  tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, cfg.vocab_size)
  logits = model.apply({"params": params}, tokens)
  assert logits.shape == (3, 16, cfg.vocab_size)
  assert logits.dtype == jnp.float32


def test_no_information_flows_from_future_tokens():
  cfg = _tiny()
  model, params = _init(cfg)
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size))
  changed = tokens.copy()
  changed[:, 9:] = (changed[:, 9:] + 7) % cfg.vocab_size
  a = model.apply({"params": params}, tokens)
  b = model.apply({"params": params}, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
  assert not np.allclose(np.asarray(a[:, 9:]), np.asarray(b[:, 9:]))  # the future does matter to itself


def test_layers_are_stacked_on_a_leading_axis():
  cfg = _tiny(num_layers=3)
  _, params = _init(cfg)
  q = params["layers"]["blocks"]["attn"]["q"]["kernel"]
  assert q.shape == (3, cfg.d_model, cfg.num_heads, cfg.head_dim)


@pytest.mark.parametrize("remat", [False, True])
def test_param_count_matches_analytic_count(remat):
  cfg = _tiny(remat=remat)
  _, params = _init(cfg)
  assert sum(x.size for x in jax.tree.leaves(params)) == model_lib.num_params(cfg)


def test_presets_match_the_paper_table():
  # docs/method.md §10: hidden / layers / MLP; heads 12 (reference code) / 32 / 32.
  assert model_lib.PRESETS["small"] == dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072)
  assert model_lib.PRESETS["medium"] == dict(d_model=2048, num_layers=24, num_heads=32, mlp_dim=8192)
  assert model_lib.PRESETS["large"] == dict(d_model=4096, num_layers=32, num_heads=32, mlp_dim=16384)
  # With the Llama-3 vocabulary of the reference code (128,002), the real sizes are ≈310M / 2.14B / 9.64B.
  counts = {}
  for name in ("small", "medium", "large"):
    c = ml_collections.ConfigDict(default.get_config().model)
    c.preset = name
    counts[name] = model_lib.num_params(model_lib.resolve_config(c, vocab_size=128_002, seq_len=1024))
  assert abs(counts["small"] / 1e6 - 310) < 1
  assert abs(counts["medium"] / 1e9 - 2.14) < 0.01
  assert abs(counts["large"] / 1e9 - 9.64) < 0.01


def test_resolve_config_overrides_preset_fields():
  c = default.get_config().model
  c.num_layers = 5
  cfg = model_lib.resolve_config(c, vocab_size=257, seq_len=64)
  assert (cfg.d_model, cfg.num_layers, cfg.vocab_size, cfg.max_seq_len) == (128, 5, 257, 64)


def test_bfloat16_compute_and_params():
  cfg = _tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model, params = _init(cfg)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  logits = model.apply({"params": params}, jnp.zeros((1, 16), jnp.int32))
  assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_rope_matches_numpy():
  x = np.random.default_rng(0).normal(size=(1, 5, 2, 8)).astype(np.float32)
  got = np.asarray(model_lib.rope(jnp.asarray(x), jnp.arange(5), 10_000.0))
  half = 4
  freqs = 10_000.0 ** (-np.arange(half) / half)
  ang = np.arange(5)[:, None] * freqs[None]
  cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
  want = np.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)
  np.testing.assert_allclose(got, want, atol=1e-5)
