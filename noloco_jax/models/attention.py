"""Causal self-attention kernels, chosen per backend (config `model.attention`).

    auto    cuDNN's fused flash attention on an NVIDIA GPU when the compute dtype is bfloat16 or float16
            and the head dimension is one cuDNN takes; `einsum` on CPU (measured faster there, see
            experiments/RESULTS.md); XLA's attention everywhere else (TPU, other GPUs).
    xla     `jax.nn.dot_product_attention(implementation="xla")`: scores in float32, softmax, values.
    cudnn   `jax.nn.dot_product_attention(implementation="cudnn")`: fails to compile off NVIDIA GPUs
            and for float32 compute (cuDNN's fused kernel takes bf16/fp16 only).
    einsum  the model's original einsum/softmax attention, kept as the reference the others are tested
            against (tests/test_attention.py).

Why a fused kernel: the einsum path materialises the [B, N, L, L] float32 scores of every layer (and
keeps them for the backward pass); cuDNN's flash attention never holds them, streaming blocks of keys
through on-chip memory, and recomputes them in its backward pass.

Layout: every implementation takes queries [B, L, N, H] and keys/values [B, L, G, H], the layout
`jax.nn.dot_product_attention` expects (sequence before heads). G (key/value heads) must divide N
(query heads): with G < N each key/value head serves N / G consecutive query heads (grouped-query
attention). Shape suffixes: B batch, L sequence, N query heads, G key/value heads, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from noloco_jax.config import model as config_model

IMPLEMENTATIONS = config_model.ATTENTIONS  # ("auto", "xla", "cudnn", "einsum")
# Head dimensions cuDNN's fused attention accepts (multiples of 8, at most 128; 256 on newer releases
# only, so not chosen automatically).
_CUDNN_MAX_HEAD_DIM = 128


def resolve(implementation: str, dtype: Any, head_dim: int, platform: str | None = None) -> str:
  """The implementation `auto` stands for on `platform` (default: JAX's default backend).

  CPU gets `einsum`: at the default job's shapes XLA:CPU runs the reference's program 2.4-3.5× faster
  than jax.nn.dot_product_attention's (forward + backward; equal at L = 1024), and both hold the same
  [B, N, L, L] scores, so the fused entry point buys nothing there.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention={implementation!r} is not valid: one of {IMPLEMENTATIONS}.")
  if implementation != "auto":
    return implementation
  platform = platform or jax.default_backend()
  fits = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM
  if platform == "cpu":
    return "einsum"
  return "cudnn" if platform == "gpu" and fits and _is_cuda() else "xla"


def _is_cuda() -> bool:
  """True when the GPU backend is CUDA (not ROCm): cuDNN exists only there."""
  try:
    return "cuda" in jax.devices("gpu")[0].client.platform_version.lower()
  except RuntimeError:
    return False


def causal_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH, implementation: str):
  """softmax(q·kᵀ/√H + causal mask)·v per head; returns [B, L, N, H] in the queries' dtype.

  `implementation` is a resolved name (xla, cudnn or einsum; see `resolve`).
  """
  if implementation == "einsum":
    return einsum_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH)
  if implementation not in ("xla", "cudnn"):
    raise ValueError(f"attention implementation {implementation!r} is not one of xla, cudnn, einsum "
                     "(resolve 'auto' first with attention.resolve).")
  return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH, is_causal=True,
                                      implementation=implementation)


def einsum_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH):
  """The reference: scores materialised in float32, masked below the diagonal, softmax, values."""
  N, G, H = q_BxLxNxH.shape[2], k_BxLxGxH.shape[2], q_BxLxNxH.shape[3]
  if N % G:
    raise ValueError(f"{G} key/value heads do not divide {N} query heads.")
  # Grouped-query attention: query head n reads key/value head n // (N / G).
  k_BxLxNxH = jnp.repeat(k_BxLxGxH, N // G, axis=2)
  v_BxLxNxH = jnp.repeat(v_BxLxGxH, N // G, axis=2)
  logits_BxNxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxNxH, k_BxLxNxH).astype(jnp.float32) / jnp.sqrt(H)
  L = q_BxLxNxH.shape[1]
  causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
  logits_BxNxLxL = jnp.where(causal_LxL, logits_BxNxLxL, jnp.finfo(jnp.float32).min)
  probs_BxNxLxL = jax.nn.softmax(logits_BxNxLxL, axis=-1).astype(q_BxLxNxH.dtype)
  return jnp.einsum("bhqs,bshk->bqhk", probs_BxNxLxL, v_BxLxNxH)
