"""inner/replicas.py: both ways of running a device's replicas equal a NumPy loop over them, the loop
really computes one replica at a time, and `auto` resolves per backend and replica count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.inner import replicas


def _one_replica(x_BxD, w_DxF, scale):
  """One replica's computation: a stacked (x, w) and a shared `scale`; returns a pytree."""
  h_BxF = jnp.tanh(x_BxD @ w_DxF) * scale
  return {"h": h_BxF, "sum": jnp.sum(h_BxF)}


def _numpy_one(x, w, scale):
  h = np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * scale
  return {"h": h, "sum": h.sum()}


@pytest.mark.parametrize("mode", ["vmap", "sequential"])
def test_each_mode_equals_a_numpy_loop_over_the_replicas(mode):
  k = 3
  rng = np.random.default_rng(0)
  x = rng.normal(size=(k, 4, 5)).astype(np.float32)
  w = rng.normal(size=(k, 5, 6)).astype(np.float32)
  got = jax.jit(replicas.over_replicas(_one_replica, mode, in_axes=(0, 0, None)))(x, w, 0.5)
  for r in range(k):
    want = _numpy_one(x[r], w[r], 0.5)
    np.testing.assert_allclose(got["h"][r], want["h"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["sum"][r], want["sum"], rtol=1e-5)
  assert got["h"].shape == (k, 4, 6) and got["sum"].shape == (k,)


def test_the_loop_computes_one_replica_at_a_time():
  """`sequential` is a loop whose body has one replica's shapes; `vmap` one batched matmul."""
  x, w = jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))
  looped = str(jax.make_jaxpr(replicas.over_replicas(_one_replica, "sequential", in_axes=(0, 0, None)))(x, w, 0.5))
  batched = str(jax.make_jaxpr(replicas.over_replicas(_one_replica, "vmap", in_axes=(0, 0, None)))(x, w, 0.5))
  assert "scan[" in looped and "length=3" in looped
  assert "f32[4,6] = dot_general" in looped and "f32[3,4,6] = dot_general" not in looped
  assert "scan[" not in batched and "f32[3,4,6] = dot_general" in batched


def test_auto_loops_on_cpu_only_and_one_replica_is_always_vmap():
  assert replicas.resolve("auto", 8, platform="cpu") == "sequential"
  assert replicas.resolve("auto", 8, platform="gpu") == "vmap"
  assert replicas.resolve("auto", 8, platform="tpu") == "vmap"
  assert replicas.resolve("vmap", 8, platform="cpu") == "vmap"  # explicit choices are kept
  assert replicas.resolve("sequential", 4, platform="gpu") == "sequential"
  for mode in ("auto", "vmap", "sequential"):  # k = 1: the same computation; the program of before
    assert replicas.resolve(mode, 1, platform="cpu") == "vmap"


def test_bad_modes_and_axes_are_one_clear_line():
  with pytest.raises(ValueError, match=r"inner.replica_map='pmap' is not valid: one of \('auto', 'vmap', 'sequential'\)"):
    replicas.resolve("pmap", 2)
  with pytest.raises(ValueError, match="resolve 'auto' first"):
    replicas.over_replicas(_one_replica, "auto")
  with pytest.raises(ValueError, match="in_axes=\\(1, 0, None\\): one entry per argument \\(3\\), each 0 or None"):
    replicas.over_replicas(_one_replica, "sequential", in_axes=(1, 0, None))(jnp.ones((2, 4, 5)), jnp.ones((2, 5, 6)), 1.0)
