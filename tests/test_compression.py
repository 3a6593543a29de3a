"""Compressed messages (outer.compression): codecs and rounds against NumPy, mesh = simulator, bytes on the wire."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.outer import compression as C
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.training import loop as train
from noloco_jax.training.state import TrainState

N = 8


# ---- NumPy references, written from the definitions in compression.py's docstring ----


def np_chunks(x, chunk):
  flat = np.ravel(x).astype(np.float64)
  width = min(chunk, -(-flat.size // 8) * 8)
  num = -(-flat.size // width)
  return np.concatenate([flat, np.zeros(num * width - flat.size)]).reshape(num, width)


def np_quantize(x_CxW, bits):
  L = 2 ** bits
  M = np.abs(x_CxW).max(-1, keepdims=True)
  safe = np.where(M > 0, M, 1.0)
  u = np.clip(np.round((x_CxW / safe + 1) * (L - 1) / 2), 0, L - 1)
  return u.astype(np.uint8), (u * 2 / (L - 1) - 1) * M


def np_dense_roundtrip(x, bits, chunk):
  _, xhat = np_quantize(np_chunks(x, chunk), bits)
  return xhat.ravel()[:x.size].reshape(x.shape)


def np_topk_roundtrip(x, density, bits, chunk):
  x_CxW = np_chunks(x, chunk)
  k = max(1, int(np.ceil(density * x_CxW.shape[1])))
  out = np.zeros_like(x_CxW)
  for row, out_row in zip(x_CxW, out):
    keep = np.argsort(-np.abs(row), kind="stable")[:k]
    _, values = np_quantize(row[keep][None], bits)
    out_row[keep] = values[0]
  return out.ravel()[:x.size].reshape(x.shape)


def _x(seed, shape=(37, 29)):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ---- Codecs ----


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_pack_bits_matches_numpy_little_endian_bit_packing(bits):
  u = np.random.default_rng(bits).integers(0, 2 ** bits, size=61).astype(np.uint8)
  packed = np.asarray(C.pack_bits(jnp.asarray(u), bits))
  padded = np.concatenate([u, np.zeros(-u.size % 8, np.uint8)])
  bit_stream = ((padded[:, None] >> np.arange(bits)) & 1).astype(np.uint8).ravel()
  want = np.packbits(bit_stream, bitorder="little") if bits < 8 else u
  np.testing.assert_array_equal(packed, want)
  assert packed.size == (-(-u.size // 8) * bits if bits < 8 else u.size)  # 8 codes in `bits` bytes
  np.testing.assert_array_equal(np.asarray(C.unpack_bits(jnp.asarray(packed), bits, u.shape)), u)


@pytest.mark.parametrize("kind,bits,chunk", [("int8", 8, 64), ("int4", 4, 64), ("int8", 8, 4096), ("int4", 4, 100)])
def test_dense_quantisation_matches_numpy(kind, bits, chunk):
  x = _x(0)
  codec = C.Codec(kind, chunk=chunk)
  payload = codec.encode({"w": jnp.asarray(x)})
  got = np.asarray(codec.decode(payload, {"w": x})["w"])
  want = np_dense_roundtrip(x, bits, chunk)
  np.testing.assert_allclose(got, want, atol=1e-6)
  x_CxW = np_chunks(x, chunk)
  bound = np.abs(x_CxW).max(-1) / (2 ** bits - 1)  # half a level step
  assert (np.abs(got.ravel() - x.ravel()) <= np.repeat(bound, x_CxW.shape[1])[:x.size] + 1e-6).all()
  assert payload["w"]["codes"].dtype == np.uint8 and payload["w"]["codes"].size == -(-x_CxW.size // 8) * bits


@pytest.mark.parametrize("density,bits,chunk", [(0.01, 2, 4096), (0.03, 2, 256), (0.1, 4, 64), (0.2, 8, 128),
                                                (1.0, 3, 64)])
def test_topk_matches_numpy(density, bits, chunk):
  x = _x(1, (300, 41))
  codec = C.Codec("topk", chunk=chunk, density=density, bits=bits)
  payload = codec.encode({"w": jnp.asarray(x)})["w"]
  got = np.asarray(codec.decode({"w": payload}, {"w": x})["w"])
  np.testing.assert_allclose(got, np_topk_roundtrip(x, density, bits, chunk), atol=1e-6)
  assert payload["index"].dtype == np.uint16
  num, width = C.chunk_shape(x.size, chunk)
  k = C.topk_count(width, density)
  assert payload["index"].shape == (num, k) and (np.count_nonzero(got) <= num * k)


def test_error_feedback_sends_everything_in_the_long_run():
  """decay=1: Σ_t sent_t = Σ_t message_t − e_T exactly (the residual telescopes), and e_T stays bounded."""
  codec = C.Codec("topk", chunk=64, density=0.05, bits=2)
  rng = np.random.default_rng(2)
  residual = {"w": jnp.zeros((40, 16), jnp.float32)}
  total_sent, total_msg = np.zeros((40, 16)), np.zeros((40, 16))
  for _ in range(30):
    msg = {"w": jnp.asarray(rng.normal(size=(40, 16)).astype(np.float32))}
    m = jax.tree.map(jnp.add, msg, residual)
    payload, residual = C.with_feedback(codec, msg, residual, 1.0)
    sent = np.asarray(codec.decode(payload, msg)["w"])
    np.testing.assert_allclose(sent, np_topk_roundtrip(np.asarray(m["w"]), 0.05, 2, 64), atol=1e-5)
    total_sent += sent
    total_msg += np.asarray(msg["w"])
  np.testing.assert_allclose(total_sent, total_msg - np.asarray(residual["w"]), atol=1e-3)
  # Without feedback, 30 rounds lose most of the signal; with it, the loss is one round's residual.
  assert np.linalg.norm(residual["w"]) < 0.5 * np.linalg.norm(total_msg)


def test_error_feedback_residual_is_decayed():
  codec = C.Codec("int4", chunk=64)
  x = {"w": jnp.asarray(_x(3, (10, 10)))}
  e0 = {"w": jnp.asarray(0.1 * _x(4, (10, 10)))}
  payload, e1 = C.with_feedback(codec, x, e0, 0.5)
  m = np.asarray(x["w"]) + np.asarray(e0["w"])
  np.testing.assert_allclose(np.asarray(e1["w"]), 0.5 * (m - np_dense_roundtrip(m, 4, 64)), atol=1e-6)
