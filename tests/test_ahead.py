"""outer/programs.py's compile-ahead: programs compiled in the background, the same numbers as jit, one
wait per round, nothing announced past the last round, a bounded cache, errors on the caller's thread."""

import time

import jax
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import methods, pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.parallel import mesh as mesh_lib

N = 8


def _programs(**kwargs):
  outer = ml_collections.ConfigDict(default.get_config().outer)
  method = methods.make(outer)
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  rng = np.random.default_rng(0)
  theta = {"w": rng.normal(size=(N, 4, 3)).astype(np.float32)}
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(),
                                    outer=jax.vmap(method.init)(theta)), mesh_lib.replica_sharding(mesh))
  return programs_lib.RoundPrograms(method, mesh, schedule, **kwargs), state


def test_prefetched_programs_are_ready_and_compute_what_jit_computes():
  programs, state = _programs()
  jitted, _ = _programs()
  copy = jax.tree.map(lambda x: x.copy(), state)
  programs.start(state, first_round=0)
  try:
    deadline = time.time() + 120
    while not (len(programs._futures) == 3 and all(f.done() for f in programs._futures.values())):
      assert time.time() < deadline  # message, merge and round 0's routes, compiled in the background
      time.sleep(0.01)
    compiled, route = programs.program(0)
    assert programs.stats.hits == 1 and programs.stats.waits_s == [0.0]  # compiled before they were needed
    got, _ = programs_lib.lockstep_round(compiled)(state, route)
    fn, route_j = jitted(0)
    want, _ = fn(copy, route_j)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    programs.close()


def test_a_round_waits_once_for_all_its_programs_and_nothing_is_announced_past_the_last_round():
  programs, state = _programs()
  programs.start(state, last_round=2, first_round=0)
  try:
    for round_ in range(3):
      compiled, _ = programs.program(round_)
      assert set(compiled) == {"message", "merge", "routes"}
    assert len(programs.stats.waits_s) == 3  # one wait per round, for the fixed programs and its routes together
    keys = [programs.plan(r)[0] for r in range(4)]
    assert keys[3] not in programs._futures or keys[3] in keys[:3]  # round 3 was never announced
    assert sorted(map(str, programs.stats.keys)) == sorted(map(str, ["message", "merge", *dict.fromkeys(keys[:3])]))
  finally:
    programs.close()
  inline, state = _programs()
  inline.start(state, compile_ahead=False)
  try:
    inline.program(0)
    assert inline.plan(1)[0] not in inline._futures  # nothing announced ahead: compiled when asked for
  finally:
    inline.close()


def test_the_cache_is_bounded_and_keeps_the_programs_every_round_runs():
  programs, state = _programs(capacity=2)
  programs.start(state)
  try:
    for round_ in range(6):
      programs.program(round_)
    assert len(programs._futures) <= 2 + 2 + 1  # capacity, the fixed programs, the newest until the next evicts
    assert {"message", "merge"} <= set(programs._futures)  # never evicted
  finally:
    programs.close()


def test_a_compile_error_surfaces_on_the_callers_thread(monkeypatch):
  programs, state = _programs()

  def broken(key):
    raise TypeError(f"cannot lower {key!r}")
  monkeypatch.setattr(programs, "_lower", broken)
  programs.start(state)
  try:
    with pytest.raises(TypeError, match="cannot lower"):
      programs.program(0)
  finally:
    programs.close()
