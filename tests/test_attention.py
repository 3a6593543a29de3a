"""Attention kernels (models/attention.py): XLA's fused-attention path equals the einsum reference,
both equal a NumPy reference, with grouped-query heads, in float32 and bfloat16; the model's output
does not depend on the choice beyond rounding; `auto` picks by backend and dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.models import attention
from noloco_jax.models import llama as model_lib


def _numpy_attention(q, k, v):
  """Causal softmax attention in float64, [B, L, N, H] queries, [B, L, G, H] keys/values."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, L, N, H = q.shape
  G = k.shape[2]
  out = np.zeros_like(q)
  for n in range(N):
    g = n // (N // G)
    s = np.einsum("bqh,bsh->bqs", q[:, :, n], k[:, :, g]) / np.sqrt(H)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[:, :, n] = np.einsum("bqs,bsh->bqh", p, v[:, :, g])
  return out


def _qkv(dtype, N=4, G=4, B=2, L=12, H=8):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(kq, (B, L, N, H), dtype), jax.random.normal(kk, (B, L, G, H), dtype),
          jax.random.normal(kv, (B, L, G, H), dtype))


@pytest.mark.parametrize("groups", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("impl", ["xla", "einsum"])
def test_matches_numpy_in_float32(impl, groups):
  q, k, v = _qkv(jnp.float32, G=groups)
  got = attention.causal_attention(q, k, v, impl)
  assert got.shape == q.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, _numpy_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), pytest.param(jnp.bfloat16, 2e-2, marks=pytest.mark.exhaustive(reason="the bfloat16 case (the float32 case stays in)"))])
def test_xla_equals_einsum_values_and_gradients(dtype, tol):
  q, k, v = _qkv(dtype, G=2)
  w = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)  # a fixed cotangent direction

  def loss(impl, q, k, v):
    return jnp.sum(attention.causal_attention(q, k, v, impl).astype(jnp.float32) * w)

  # The loss sums 768 terms of size about 1 to about 0.6, so its rounding is relative to the terms, not
  # to the sum: tol × Σ|term| bounds what float32 (bfloat16) rounding in either kernel can move it.
  terms = float(jnp.sum(jnp.abs(attention.causal_attention(q, k, v, "einsum").astype(jnp.float32) * w)))
  np.testing.assert_allclose(loss("xla", q, k, v), loss("einsum", q, k, v), rtol=tol, atol=tol * terms)
  ga = jax.grad(loss, argnums=(1, 2, 3))("xla", q, k, v)
  gb = jax.grad(loss, argnums=(1, 2, 3))("einsum", q, k, v)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), pytest.param("bfloat16", 5e-2, marks=pytest.mark.exhaustive(reason="the bfloat16 case (the float32 case stays in)"))])
def test_model_logits_do_not_depend_on_the_kernel(dtype, tol):
  cfgs = {impl: model_lib.LlamaConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4, mlp_dim=64,
                                      max_seq_len=16, dtype=model_lib.DTYPES[dtype], attention=impl)
          for impl in ("einsum", "xla", "auto")}
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 40)
  params = model_lib.Llama(cfgs["einsum"]).init(jax.random.key(0), tokens)["params"]
  logits = {impl: model_lib.Llama(c).apply({"params": params}, tokens) for impl, c in cfgs.items()}
  np.testing.assert_allclose(logits["xla"], logits["einsum"], rtol=tol, atol=tol)
  np.testing.assert_array_equal(logits["auto"], logits["einsum"])  # auto is einsum on CPU


def test_auto_resolves_per_backend_and_dtype():
  assert attention.resolve("auto", jnp.bfloat16, 64, platform="cpu") == "einsum"
  assert attention.resolve("auto", jnp.bfloat16, 64, platform="tpu") == "xla"
  # On CPU there is no CUDA GPU, so even a GPU-shaped request stays on XLA.
  assert attention.resolve("auto", jnp.bfloat16, 64, platform="gpu") == "xla"
  assert attention.resolve("einsum", jnp.float32, 64) == "einsum"
  assert attention.resolve("cudnn", jnp.float32, 64) == "cudnn"  # explicit choices are kept
  with pytest.raises(ValueError, match="model.attention='flash'"):
    attention.resolve("flash", jnp.float32, 64)
