r"""Checkpoint save and restore time and size for a config (default: configs/default.py, 8 replicas).

    python experiments/bench_checkpoint.py                  # prints one JSON object
    python experiments/bench_checkpoint.py --config.model.preset=small --config.num_replicas=2

Saves the replica-stacked TrainState (filled with noise, so that it compresses like a trained one)
`--saves` times through
noloco_jax.io.checkpoint.Checkpointer (exactly what the training loop saves: state, meta and data items),
once with asynchronous and once with synchronous saves, then restores the latest. Reports:
  state_bytes        bytes of the TrainState on the devices (θ, inner Adam μ and ν, φ, δ, counters);
  checkpoint_bytes   bytes of one step directory on disk;
  save_blocking_s    async: how long the training loop is held per save (median);
  save_async_total_s async: save start until the step is complete on disk (median);
  save_sync_s        synchronous save (median);
  restore_s          reading the latest step back onto the mesh (meta, state, data);
  checksum_s         the per-replica state checksum every save stores and every restore verifies
                     (io/checkpoint/checksum.py; median of --saves calls after one that compiles).
"""

import dataclasses
import os
import statistics
import tempfile
import time

from experiments.lib import harness


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _like_trained(state):
  """The state with every float replaced by noise: a fresh state is mostly zeros (μ, ν, δ) and the
  same weights on every replica, which compress far better than a trained state would."""
  import jax  # pylint: disable=g-import-not-at-top

  def noise(tree):
    leaves, treedef = jax.tree.flatten(tree)
    key = jax.random.key(0)
    leaves = [jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
              if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, leaves)

  shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.block_until_ready(jax.jit(noise, out_shardings=shardings)(state))


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True)
  bench.add_argument("--saves", type=int, default=5, help="saves to time per mode")
  args = bench.parse(argv)
  config = bench.override(bench.config())
  harness.use_cpu_devices(config.num_replicas)  # one CPU device per replica, as main.py (CPU backend only)
  import jax  # pylint: disable=g-import-not-at-top
  from noloco_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  from noloco_jax.io.checkpoint import checksum  # pylint: disable=g-import-not-at-top
  from noloco_jax.io import data  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import run as run_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training.loop_state import LoopState  # pylint: disable=g-import-not-at-top

  setup = build_lib.build(config)
  state = _like_trained(setup.init_state())
  train_iter = data.make_train_iterator(
      config.data, seed=config.seed, replica_ids=mesh_lib.local_replica_ids(setup.mesh, config.num_replicas),
      num_replicas=config.num_replicas, vocab_size=setup.model.vocab_size)
  out = {"replicas": config.num_replicas, "devices": int(setup.mesh.devices.size), "backend": jax.default_backend(),
         "model": config.model.preset, "params_per_replica": setup.model.num_params(),
         "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state))}

  checksum.state_checksums(state, setup.mesh)  # compiles
  times = []
  for _ in range(args.saves):
    start = time.perf_counter()
    checksum.state_checksums(state, setup.mesh)
    times.append(time.perf_counter() - start)
  out["checksum_s"] = statistics.median(times)

  for mode in ("async", "sync"):
    # The checkpointer's own section, per mode (setup.config is the record parsed once, frozen).
    info = dataclasses.replace(run_lib.checkpoint_info(setup),
                               checkpoint=setup.config.checkpoint.replace(async_save=mode == "async"))
    with tempfile.TemporaryDirectory() as workdir:
      ckpt = checkpoint.Checkpointer(info, workdir)
      blocking, total = [], []
      for step in range(1, args.saves + 1):
        start = time.perf_counter()
        ckpt.save(step, state, LoopState(step=step), train_iter)
        blocking.append(time.perf_counter() - start)
        ckpt.wait_until_finished()
        total.append(time.perf_counter() - start)
      ckpt.close()
      if mode == "async":
        out["save_blocking_s"] = statistics.median(blocking)
        out["save_async_total_s"] = statistics.median(total)
        out["checkpoint_bytes"] = _dir_bytes(os.path.join(ckpt.directory, str(args.saves)))
      else:
        out["save_sync_s"] = statistics.median(total)
        start = time.perf_counter()
        restored, resume = checkpoint.Checkpointer(info, workdir).restore(jax.eval_shape(setup.init_state), train_iter,
                                                                          LoopState())
        jax.block_until_ready(restored)
        out["restore_s"] = time.perf_counter() - start
        assert resume.step == args.saves
  train_iter.close()
  return bench.finish(out)


if __name__ == "__main__":
  harness.run(main)
