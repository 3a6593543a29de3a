"""Codecs for the exchanged message: per-chunk scaled quantisation and per-chunk top-k, bit-packed.

Every function here is pure and works on ONE replica's array (vmap it over a stack). A leaf of n values
is flattened and cut into chunks of `width = min(chunk, n rounded up to 8)` values (zero padded), so a
small leaf (a bias) costs one small chunk, not a 4096-wide one. What a codec returns is the payload that
crosses the network: its arrays are exactly the operands of the collective-permutes, so the bytes on the
wire are `tree_bytes(payload)` and nothing else (tests/test_compression.py checks it on compiled HLO).

Quantisation with b bits uses the L = 2^b levels spread evenly over [−M, M], M = max |x| in the chunk:
    u = round((x / M + 1) · (L − 1) / 2) ∈ {0 … L−1},    x̂ = (2u / (L − 1) − 1) · M.
The extremes ±M are exact and the error is at most M / (L − 1). With b = 2 the levels are ±M, ±M/3
(no zero level: top-k values are the large ones, so a zero level would waste a quarter of the codes).
M travels as one float32 per chunk.

Top-k keeps, in every chunk, the k = ceil(density · width) entries of largest magnitude: their offsets
within the chunk as uint16 (hence width ≤ 65536) and their values quantised to b bits as above.

Packing: b-bit codes are stored b bits at a time, little-endian within each byte, so 8 codes take
exactly b bytes (int4: two codes per byte; 2 bits: four per byte).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np



def chunk_shape(n: int, chunk: int) -> tuple[int, int]:
  """(number of chunks, chunk width) for a leaf of n values."""
  width = min(chunk, -(-n // 8) * 8)
  return -(-n // width), width


def to_chunks(x, chunk: int):
  """Flattened, zero padded to whole chunks: [num_chunks, width] float32."""
  num, width = chunk_shape(x.size, chunk)
  flat = jnp.ravel(x).astype(jnp.float32)
  return jnp.pad(flat, (0, num * width - x.size)).reshape(num, width)


def from_chunks(x_CxW, shape):
  return x_CxW.reshape(-1)[:math.prod(shape)].reshape(shape)


def quantize(x_CxW, bits: int):
  """Codes u (uint8, same shape) and the per-row scale M (float32 [C])."""
  levels = 2 ** bits - 1
  scale_C = jnp.max(jnp.abs(x_CxW), axis=-1)
  safe_C = jnp.where(scale_C > 0, scale_C, 1.0)
  u = jnp.round((x_CxW / safe_C[:, None] + 1.0) * (levels / 2.0))
  return jnp.clip(u, 0, levels).astype(jnp.uint8), scale_C


def dequantize(u, scale_C, bits: int):
  levels = 2 ** bits - 1
  # (2u − (L−1)) is an exact small integer, so the result is one rounding of one product, and an
  # optimization barrier keeps XLA from contracting it into a fused multiply-add with later sums: the
  # compiled programs of the mesh and the simulator then decode to the same bits.
  odd = 2.0 * u.astype(jnp.float32) - levels
  return jax.lax.optimization_barrier(odd * (scale_C / levels)[:, None])


def pack_bits(u, bits: int):
  """uint8 codes < 2^bits (any shape) -> uint8[ceil(size · bits / 8)], codes zero padded to a multiple of 8."""
  flat = jnp.ravel(u)
  if bits == 8:
    return flat
  flat = jnp.pad(flat, (0, -flat.size % 8))
  bits_MxB = (flat[:, None] >> jnp.arange(bits, dtype=jnp.uint8)) & 1
  bits_Px8 = bits_MxB.reshape(-1, 8)
  return jnp.sum(bits_Px8 << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed, bits: int, shape):
  """Inverse of pack_bits: the uint8 codes of `shape`."""
  count = math.prod(shape)
  if bits == 8:
    return packed[:count].reshape(shape)
  bits_Px8 = (packed[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  bits_MxB = bits_Px8.reshape(-1, bits)
  codes = jnp.sum(bits_MxB << jnp.arange(bits, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)
  return codes[:count].reshape(shape)


def encode_dense(x, *, bits: int, chunk: int) -> dict:
  u, scale_C = quantize(to_chunks(x, chunk), bits)
  return {"codes": pack_bits(u, bits), "scale": scale_C}


def decode_dense(payload: dict, shape, *, bits: int, chunk: int):
  u = unpack_bits(payload["codes"], bits, chunk_shape(math.prod(shape), chunk))
  return from_chunks(dequantize(u, payload["scale"], bits), shape)


def topk_count(width: int, density: float) -> int:
  return max(1, min(width, math.ceil(density * width)))


def encode_topk(x, *, density: float, bits: int, chunk: int) -> dict:
  x_CxW = to_chunks(x, chunk)
  k = topk_count(x_CxW.shape[1], density)
  _, index_CxK = jax.lax.top_k(jnp.abs(x_CxW), k)
  u, scale_C = quantize(jnp.take_along_axis(x_CxW, index_CxK, axis=-1), bits)
  return {"index": index_CxK.astype(jnp.uint16), "codes": pack_bits(u, bits), "scale": scale_C}


def decode_topk(payload: dict, shape, *, density: float, bits: int, chunk: int):
  num, width = chunk_shape(math.prod(shape), chunk)
  index_CxK = payload["index"].astype(jnp.int32)
  values_CxK = dequantize(unpack_bits(payload["codes"], bits, index_CxK.shape), payload["scale"], bits)
  rows_CxK = jnp.broadcast_to(jnp.arange(num)[:, None], index_CxK.shape)
  x_CxW = jnp.zeros((num, width), jnp.float32).at[rows_CxK, index_CxK].set(values_CxK)
  return from_chunks(x_CxW, shape)


@dataclasses.dataclass(frozen=True)
class Codec:
  """One way of sending a float32 pytree: `encode(tree) -> payload`, `decode(payload, like) -> tree`.

  kind: float32 | bfloat16 (a cast) | int8 | int4 (dense quantisation) | topk.
  """
  kind: str
  chunk: int = 4096
  density: float = 1.0  # topk only
  bits: int = 8  # topk only (int8 / int4 imply 8 / 4)

  @property
  def value_bits(self) -> int:
    return {"int8": 8, "int4": 4}.get(self.kind, self.bits)

  def _encode_leaf(self, x):
    if self.kind in ("float32", "bfloat16"):
      return x.astype(self.kind)
    if self.kind == "topk":
      return encode_topk(x, density=self.density, bits=self.bits, chunk=self.chunk)
    return encode_dense(x, bits=self.value_bits, chunk=self.chunk)

  def _decode_leaf(self, payload, shape):
    if self.kind in ("float32", "bfloat16"):
      return payload.astype(jnp.float32)
    if self.kind == "topk":
      return decode_topk(payload, shape, density=self.density, bits=self.bits, chunk=self.chunk)
    return decode_dense(payload, shape, bits=self.value_bits, chunk=self.chunk)

  def encode(self, tree):
    """Payload pytree for one replica's float32 tree (a dict per leaf for the packed codecs)."""
    return jax.tree.map(self._encode_leaf, tree)

  def decode(self, payload, like):
    """float32 tree shaped like `like` (one replica) from a payload made by `encode`."""
    leaves, treedef = jax.tree.flatten(like)
    payloads = treedef.flatten_up_to(payload)
    return treedef.unflatten([self._decode_leaf(p, x.shape) for p, x in zip(payloads, leaves)])


def with_feedback(codec: Codec, message, residual, decay: float):
  """Error feedback: sends m = message + residual; returns (payload, new residual = decay · (m − sent)).

  `residual` is None when feedback is off (then the payload is just encode(message)).
  """
  if residual is None:
    return codec.encode(message), None
  m = jax.tree.map(jnp.add, message, residual)
  payload = codec.encode(m)
  sent = codec.decode(payload, m)
  return payload, jax.tree.map(lambda a, b: decay * (a - b), m, sent)


def payload_bytes(codec: Codec, params) -> int:
  """Bytes of one replica's payload for params of these shapes (computed from shapes, nothing runs)."""
  shapes = jax.eval_shape(codec.encode, jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params))
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))
