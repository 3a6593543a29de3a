"""outer/ahead.py: programs compiled in the background, the same numbers as jit, a bounded cache."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax.outer import ahead


def _build(key):
  shift = key
  return jax.jit(lambda x, i: jnp.roll(x, shift) + i)


def _lower(x):
  structs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.int32))
  return lambda key: _build(key).lower(*structs)


def test_prefetched_programs_are_ready_and_compute_what_jit_computes():
  x = jnp.arange(6.0)
  compiler = ahead.AheadCompiler(_lower(x))
  try:
    compiler.prefetch(1)
    deadline = time.time() + 60
    while compiler.stats.compiles < 1 and time.time() < deadline:
      time.sleep(0.01)
    program = compiler.get(1)
    assert compiler.stats.hits == 1 and compiler.stats.waits_s == [0.0]  # compiled before it was needed
    np.testing.assert_array_equal(program(x, jnp.int32(2)), _build(1)(x, jnp.int32(2)))
    compiler.get(3)  # never announced: compiled on demand, and the wait is recorded
    assert compiler.stats.compiles == 2 and len(compiler.stats.waits_s) == 2
  finally:
    compiler.close()


def test_the_cache_is_bounded_and_keeps_recent_programs():
  x = jnp.zeros(4)
  compiler = ahead.AheadCompiler(_lower(x), capacity=2)
  try:
    for key in range(5):
      compiler.get(key)
    assert len(compiler) <= 3  # capacity, plus the newest until the next compile evicts
    compiler.get(4)
    compiler.get(3)
    assert compiler.stats.compiles == 5  # 3 and 4 were still cached
    compiler.get(0)
    assert compiler.stats.compiles == 6 and len(compiler) <= 3  # 0 had been evicted
    with pytest.raises(ValueError, match="capacity"):
      ahead.AheadCompiler(_lower(x), capacity=1)
  finally:
    compiler.close()


def test_a_compile_error_surfaces_on_the_callers_thread():
  def bad(key):
    return jax.jit(lambda x: x @ x)  # [3] @ [3] is fine, [3, 2] @ [3, 2] is not
  compiler = ahead.AheadCompiler(lambda key: bad(key).lower(jax.ShapeDtypeStruct((3, 2), jnp.float32)))
  try:
    with pytest.raises(TypeError):
      compiler.get("k")
  finally:
    compiler.close()


def test_a_round_waits_once_for_all_its_programs_and_nothing_is_announced_past_the_last_round():
  x = jnp.arange(6.0)
  plan = lambda round_: (round_ + 10, np.asarray(round_))  # a new program key every round
  compose = lambda fixed, own: (fixed, own)
  programs = ahead.RoundPrograms(plan, _lower(x), fixed=(1,), compose=compose, last_round=2)
  try:
    programs.prefetch(0)
    for round_ in range(3):
      (fixed, own), route = programs.program(round_)
      np.testing.assert_array_equal(own(x, jnp.int32(0)), _build(round_ + 10)(x, jnp.int32(0)))
      assert int(route) == round_
    stats = programs.compiler.stats
    assert len(stats.waits_s) == 3  # one wait per round, for the fixed program and its own together
    assert sorted(stats.keys) == [1, 10, 11, 12]  # round 3 (key 13) was never announced
    assert 13 not in programs.compiler._futures
  finally:
    programs.close()
  inline = ahead.RoundPrograms(plan, _lower(x), compile_ahead=False)
  try:
    inline.program(0)
    assert 11 not in inline.compiler._futures  # nothing announced ahead: compiled when asked for
  finally:
    inline.close()
