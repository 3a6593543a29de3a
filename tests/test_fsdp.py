"""Sharding inside a replica (the `fsdp` mesh axis), gradient accumulation and outer-state offload.

The numerical test trains 4 replicas × fsdp 2 on 8 fake CPU devices against 4 replicas × fsdp 1 (the
same run without fsdp) for a few steps and one NoLoCo round. Only the order of float32 reductions
differs (gradients summed across two devices, micro-batches summed in a loop), so the states agree to
rounding: |Δ| ≤ 1e-5 absolute on every leaf of θ, Adam moments, φ and δ (measured ~1e-7), losses to
rtol 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from noloco_jax.outer import programs as programs_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.training import build as build_lib

N, STEPS, VOCAB = 4, 2, 257


def test_leaf_spec_splits_the_largest_divisible_dimension():
  assert sharding_lib.leaf_spec((4, 12, 768, 3072), 4) == P("replica", None, None, "fsdp")  # mlp_dim
  assert sharding_lib.leaf_spec((4, 128_002, 768), 4) == P("replica", None, "fsdp")  # vocab does not divide
  assert sharding_lib.leaf_spec((4, 128_256, 768), 4) == P("replica", "fsdp", None)  # it does
  assert sharding_lib.leaf_spec((4, 6, 6), 4) == P("replica")  # nothing divides: replicated
  assert sharding_lib.leaf_spec((4,), 2) == P("replica")  # counters
  assert sharding_lib.leaf_spec((4, 768), 1) == P("replica")  # no fsdp axis to use


def test_mesh_groups_consecutive_devices_per_replica():
  mesh = mesh_lib.make_mesh(N, fsdp=2)
  assert dict(mesh.shape) == {"replica": 4, "fsdp": 2}
  ids = [[d.id for d in row] for row in mesh_lib.replica_groups(mesh)]
  assert ids == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert mesh_lib.process_layout(mesh, 8) == {0: {"devices": list(range(8)), "replicas": list(range(8))}}
  assert mesh_lib.local_replica_ids(mesh, 8) == list(range(8))
  with pytest.raises(ValueError, match="fsdp=3"):
    mesh_lib.make_mesh(N, fsdp=3)


def _train(fsdp: int, microbatches: int = 1, offload: bool = False, loss_chunk: int = 0):
  cfg = default.get_config("smoke")
  cfg.model.loss_chunk = loss_chunk
  cfg.num_replicas, cfg.fsdp, cfg.data.batch_size = N, fsdp, 4
  cfg.inner.microbatches, cfg.outer.offload = microbatches, offload
  cfg.outer.pairing = "fresh"  # one grouping per compiled round: its collectives are one round's
  setup = build_lib.build(cfg, vocab_size=VOCAB)
  state = setup.init_state()
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(STEPS):
    batch = rng.integers(0, VOCAB, size=(N, 4, cfg.data.seq_len + 1)).astype(np.int32)
    state, metrics = setup.inner_step(state, sharding_lib.global_array(setup.mesh, batch, N))
    losses.append(np.asarray(metrics["loss"]))
  compiled = setup.rounds.compile(state, 0)  # the loop's round programs, compiled once, run and read
  state, _ = programs_lib.lockstep_round(compiled)(state, jnp.int32(setup.rounds.plan(0)[1]))
  return setup, state, np.stack(losses), "\n".join(c.as_text() for c in compiled.values())


@pytest.fixture(scope="module")
def unsharded():
  """The fsdp=1 reference run, shared by the tests below (one compile and run for all)."""
  return _train(fsdp=1)


def test_fsdp_training_equals_unsharded_training(unsharded):
  base_setup, base, base_losses, base_hlo = unsharded
  # fsdp 2, with gradient accumulation over 2 micro-batches and φ, δ offloaded to host memory on top:
  # none of them may change the numbers.
  setup, sharded, losses, hlo = _train(fsdp=2, microbatches=2, offload=True)

  kernel = sharded.params["layers"]["blocks"]["mlp"]["up"]["kernel"]
  assert kernel.sharding.spec == P("replica", None, None, "fsdp")
  assert kernel.addressable_shards[0].data.shape == (1,) + kernel.shape[1:-1] + (kernel.shape[-1] // 2,)
  assert sharded.outer["slow"]["layers"]["blocks"]["mlp"]["up"]["kernel"].sharding.memory_kind == "pinned_host"

  np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5),
               sharded, base)

  # Each fsdp device sends only its shard: per device half the bytes, per replica the same total.
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), base.params)
  per_replica = setup.method.traffic(one, setup.config.num_replicas)[0].operand
  assert hlo_lib.collective_bytes(base_hlo, "collective-permute") == per_replica
  assert 2 * hlo_lib.collective_bytes(hlo, "collective-permute") == per_replica


def test_a_chunked_loss_split_over_fsdp_equals_the_plain_unsharded_loss(unsharded):
  """model.loss_chunk with the batch split over fsdp: the chunks cut the sequence, never the batch."""
  _, base, base_losses, _ = unsharded
  _, chunked, losses, _ = _train(fsdp=2, loss_chunk=12)  # 12 does not divide seq_len 32: padded chunk
  np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5),
               chunked, base)
