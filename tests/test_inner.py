"""Inner step: learning works, the replica-mapped step equals per-replica steps, the schedule is right."""

import functools

import jax
import numpy as np
import pytest

from configs import default
from noloco_jax.inner import step as inner
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.training import build as build_lib

N = 8


def _config(kind="none", **kw):
  cfg = default.get_config("smoke")
  cfg.outer.kind = kind
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _batches(cfg, seed=0, vocab=257):
  rng = np.random.default_rng(seed)
  # Low-entropy batches (a few repeating tokens), so that a few steps visibly reduce the loss.
  return rng.integers(0, 8, size=(cfg.num_replicas, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)


def test_inner_steps_lower_the_loss_on_a_fixed_batch():
  cfg = _config()
  setup = build_lib.build(cfg, vocab_size=257)
  state = setup.init_state()
  batch = sharding_lib.global_array(setup.mesh, _batches(cfg), N)
  losses = []
  for _ in range(6):
    state, metrics = setup.inner_step(state, batch)
    losses.append(np.asarray(metrics["loss"]))
  assert (losses[-1] < losses[0] - 0.5).all(), losses


def test_replicas_start_identical():
  setup = build_lib.build(_config(), vocab_size=257)
  state = setup.init_state()
  for leaf in jax.tree.leaves(state):
    leaf = np.asarray(leaf)
    assert leaf.shape[0] == N
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
  assert float(setup.weight_std(state.params)) == 0.0


# (num_devices, inner.replica_map): one replica per device; 8 on one device batched; 8 on one device in a loop
# (what `auto` picks on CPU).
@pytest.mark.parametrize("num_devices,replica_map", [(8, "auto"), (1, "vmap"), (1, "sequential")])
def test_mapped_step_equals_each_replica_stepped_alone(num_devices, replica_map):
  cfg = _config(num_devices=num_devices)
  cfg.inner.replica_map = replica_map
  setup = build_lib.build(cfg, vocab_size=257)
  assert setup.replica_map == ("vmap" if replica_map == "auto" else replica_map)  # k = 1: always vmap
  state = setup.init_state()
  batches = _batches(cfg, seed=1)
  one = jax.tree.map(lambda x: np.asarray(x)[0], state)
  optimizer = inner.make_optimizer(cfg.inner, cfg.num_steps)

  @jax.jit
  def single_step(s, b):  # a plain single-replica step: no mesh, no vmap, no shard_map
    loss, grads = inner.compute_grads(s.params, b, setup.model.loss)
    return inner.apply_grads(s, grads, optimizer), loss

  mapped = state
  for step in range(2):
    mapped, metrics = setup.inner_step(mapped, sharding_lib.global_array(setup.mesh, batches, N))
  eval_k = np.asarray(setup.eval_step(mapped.params, batches[0]))
  single_eval = jax.jit(lambda p, b: inner.loss_fn(p, b, setup.model.loss))
  for r in range(N):
    s = one
    for step in range(2):
      s, loss = single_step(s, batches[r])
    got = jax.tree.map(lambda x: np.asarray(x)[r], mapped)
    if replica_map == "sequential":
      # The loop's body is the single-replica step itself: equal to float32 rounding (measured: the
      # losses and θ bit for bit, Adam's moments within one ulp), θ and both moments alike.
      np.testing.assert_allclose(np.asarray(metrics["loss"])[r], loss, rtol=1e-6)
      jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-9), got, s)
      np.testing.assert_allclose(eval_k[r], single_eval(s.params, batches[0]), rtol=1e-6)
      continue
    np.testing.assert_allclose(np.asarray(metrics["loss"])[r], loss, rtol=1e-5)
    # Adam divides by sqrt(v): float rounding of near-zero gradients differs between the two compiled
    # programs and is amplified, hence an absolute tolerance well below one update (lr ~ 1e-3).
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=2e-5, rtol=1e-4), got.params, s.params)
    np.testing.assert_allclose(eval_k[r], single_eval(s.params, batches[0]), rtol=1e-5)


def test_auto_builds_the_loop_for_cpu_and_vmap_for_an_accelerator():
  """`auto` resolves from the devices' platform; the dry run passes the accelerator it stands in for."""
  cfg = _config(num_devices=1)  # 8 replicas on one device
  assert build_lib.build(cfg, vocab_size=257).replica_map == "sequential"  # these are CPU devices
  assert build_lib.build(cfg, vocab_size=257, platform="gpu").replica_map == "vmap"
  cfg.inner.replica_map = "sequential"  # an explicit choice is kept on any platform
  assert build_lib.build(cfg, vocab_size=257, platform="gpu").replica_map == "sequential"


def test_the_replica_loop_with_fsdp_microbatches_and_ddp_equals_vmap():
  """The loop inside the shard_map with `fsdp` automatic (2 devices per replica), gradient accumulation,
  and ddp's gradient all-reduce between the two halves of the step: the same training as vmap."""
  results = {}
  for how in ("vmap", "sequential"):
    cfg = _config(kind="ddp", num_replicas=4, num_devices=2, fsdp=2)
    cfg.data.batch_size, cfg.inner.microbatches, cfg.inner.replica_map = 4, 2, how
    setup = build_lib.build(cfg, vocab_size=257)
    assert setup.replica_map == how
    state = setup.init_state()
    for seed in range(2):
      state, metrics = setup.inner_step(state, sharding_lib.global_array(setup.mesh, _batches(cfg, seed), 4))
    results[how] = (np.asarray(metrics["loss"]), jax.tree.map(np.asarray, state))
  np.testing.assert_allclose(results["sequential"][0], results["vmap"][0], rtol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-5), results["sequential"][1],
               results["vmap"][1])
  assert float(np.std(results["sequential"][1].params["head"]["kernel"], axis=0).max()) < 1e-7  # ddp: identical


def test_learning_rate_schedule_matches_numpy():
  cfg = default.get_config().inner
  cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio = 1e-3, 10, 0.1
  schedule = inner.learning_rate_schedule(cfg, 110)
  for step in (0, 5, 10, 50, 110, 200):
    if step < 10:
      want = 1e-3 * step / 10
    else:
      t = min(step - 10, 100) / 100
      want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * t))
    np.testing.assert_allclose(float(schedule(step)), want, rtol=1e-5, atol=1e-9)


def test_ddp_replicas_stay_identical():
  cfg = _config(kind="ddp")
  setup = build_lib.build(cfg, vocab_size=257)
  state = setup.init_state()
  for seed in range(2):
    state, _ = setup.inner_step(state, sharding_lib.global_array(setup.mesh, _batches(cfg, seed), N))
  assert float(setup.weight_std(state.params)) < 1e-7
