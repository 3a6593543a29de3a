"""Next-token cross-entropy, plain or chunked over the sequence for large vocabularies (`model.loss_chunk`).

The plain loss multiplies the final hidden states by the head into [B, L, V] float32 logits, then
takes a log-softmax: for the paper's 128,002-token vocabulary and 8 × 1024 tokens that is 4.2 GB of
logits, plus as much again for their gradient. `chunked_cross_entropy` computes the same mean loss
c sequence positions at a time (a [B, c, V] float32 block), so the head's memory is bounded by the
chunk whatever the sequence length.

Gradient, and the head's FLOPs. Write T = B·L tokens, D the model width, V the vocabulary, and
1 unit = one T×D by D×V matmul (2·T·D·V FLOPs). The plain loss costs 3 units per training step: the
forward logits, and in the backward pass dx = dlogits·Wᵀ and dW = xᵀ·dlogits. A `lax.scan` over
chunks under `jax.checkpoint` costs 4: its backward pass recomputes every chunk's logits before the
two gradient matmuls. Here the loss is a scalar, so its gradient can be finished in the forward pass:
under differentiation (`jax.custom_vjp`'s forward rule) each chunk's logits are computed ONCE, turned
at once into dlogits = softmax − one_hot, and into that chunk's dx and its share of dW; the backward
rule only scales the stored dx and dW by the incoming cotangent. That is 3 units, as for the plain
loss, and no logits survive their chunk. Without differentiation (evaluation) only the logits are
computed: 1 unit. Memory held from the forward to the backward pass: dx [B, L, D] in the compute
dtype (the size of the hidden states) and dW [D, V] in the head's dtype (the size of the head's gradient).

Shape suffixes: B batch, L sequence, D model width, V vocabulary, C chunk positions, n chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxLxV, targets_BxL):
  """Mean next-token cross-entropy in nats, from materialised logits (the plain loss)."""
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1))


def chunked_cross_entropy(x_BxLxD, w_DxV, targets_BxL, chunk: int):
  """Mean cross-entropy of logits x·W against the targets, `chunk` sequence positions at a time.

  x: final hidden states in the compute dtype (the head matmul runs in it, accumulating in float32);
  w: the head's kernel (any float dtype; its gradient comes back in it); targets: int token ids.
  L need not be a multiple of `chunk`: the last chunk is padded and the padding carries no weight.
  """
  if chunk < 1:
    raise ValueError(f"chunk={chunk} is not valid: an integer ≥ 1 (sequence positions per chunk).")
  return _chunked(x_BxLxD, w_DxV, targets_BxL, min(int(chunk), x_BxLxD.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(x_BxLxD, w_DxV, targets_BxL, chunk):
  loss, _ = _scan_chunks(x_BxLxD, w_DxV, targets_BxL, chunk, with_grads=False)
  return loss


def _chunked_fwd(x_BxLxD, w_DxV, targets_BxL, chunk):
  loss, grads = _scan_chunks(x_BxLxD, w_DxV, targets_BxL, chunk, with_grads=True)
  return loss, grads


def _chunked_bwd(chunk, grads, g):
  del chunk
  dx_BxLxD, dw_DxV = grads
  # None: the integer targets get no cotangent.
  return (g * dx_BxLxD).astype(dx_BxLxD.dtype), (g * dw_DxV).astype(dw_DxV.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _scan_chunks(x_BxLxD, w_DxV, targets_BxL, chunk: int, with_grads: bool):
  """(mean loss, residuals): the loss and, with `with_grads`, its gradients (dx, dW) for cotangent 1."""
  B, L, D = x_BxLxD.shape
  V = w_DxV.shape[1]
  n = -(-L // chunk)
  pad = n * chunk - L
  # Chunks cut the sequence axis, not the batch axis: a batch split over devices (fsdp) stays split
  # the same way inside every chunk, so chunking adds no communication of activations.
  x_nxBxCxD = jnp.pad(x_BxLxD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
  t_nxBxC = jnp.pad(targets_BxL, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
  valid_nxC = (jnp.arange(n * chunk) < L).reshape(n, chunk)
  w_DxV_c = w_DxV.astype(x_BxLxD.dtype)  # the head in the compute dtype, as nn.Dense would use it
  weight = 1.0 / (B * L)  # each real token's share of the mean

  def body(carry, inputs):
    x_BxCxD, t_BxC, valid_C = inputs
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", x_BxCxD, w_DxV_c, preferred_element_type=jnp.float32)
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    target_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
    loss_sum = carry[0] + jnp.sum(jnp.where(valid_C, lse_BxC - target_BxC, 0.0))
    if not with_grads:
      return (loss_sum,), None
    # d(mean loss)/d logits = (softmax − one_hot(target)) / T on real tokens, 0 on padding.
    probs_BxCxV = jnp.exp(logits_BxCxV - lse_BxC[..., None])
    onehot_BxCxV = t_BxC[..., None] == jnp.arange(V)
    scale_C = jnp.where(valid_C, weight, 0.0)
    dlogits_BxCxV = ((probs_BxCxV - onehot_BxCxV) * scale_C[:, None]).astype(x_BxLxD.dtype)
    dx_BxCxD = jnp.einsum("bcv,dv->bcd", dlogits_BxCxV, w_DxV_c,
                          preferred_element_type=jnp.float32).astype(x_BxLxD.dtype)
    # dW is summed over chunks in float32 (one head-sized buffer), whatever the compute dtype.
    dw_DxV = carry[1] + jnp.einsum("bcd,bcv->dv", x_BxCxD, dlogits_BxCxV, preferred_element_type=jnp.float32)
    return (loss_sum, dw_DxV), dx_BxCxD

  # Inside shard_map a scan's carry must vary over the mesh axes exactly as its updates do, i.e. as
  # x and w together: a zero built from both inherits that.
  zero = jnp.zeros_like(x_BxLxD[0, 0, 0], jnp.float32) + jnp.zeros_like(w_DxV[0, 0], jnp.float32)
  if not with_grads:
    (loss_sum,), _ = jax.lax.scan(body, (zero,), (x_nxBxCxD, t_nxBxC, valid_nxC))
    return loss_sum * weight, None
  (loss_sum, dw_DxV), dx_nxBxCxD = jax.lax.scan(
      body, (zero, jnp.zeros((D, V), jnp.float32) + zero), (x_nxBxCxD, t_nxBxC, valid_nxC))
  dx_BxLxD = dx_nxBxCxD.swapaxes(0, 1).reshape(B, n * chunk, D)[:, :L]
  return loss_sum * weight, (dx_BxLxD, dw_DxV.astype(w_DxV.dtype))
