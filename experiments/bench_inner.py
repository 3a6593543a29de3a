"""Inner-step throughput of the replica mesh against a plain single-replica step, as a ratio.

Compares, for the same model and per-replica batch:
  mapped:     one call of the jitted shard_map'd inner step that advances all N replicas (N devices);
  sequential: N calls of a plain jitted single-replica step (no mesh, no vmap, no shard_map) on one device.
ratio = throughput(mapped) / throughput(sequential) = time(sequential) / time(mapped). The two are
timed alternately in the same process, several times, and the median ratio is reported, so that
machine noise hits both sides alike.

    python experiments/bench_inner.py --json                       # default config, 8 replicas
    python experiments/bench_inner.py --steps=20 --config=configs/default.py:smoke --json
"""

from __future__ import annotations

import statistics
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=lambda args: args.replicas)
  bench.add_argument("--replicas", type=int, default=8)
  bench.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
  bench.add_argument("--repeats", type=int, default=5, help="alternating repetitions of both sides")
  args = bench.parse(argv)
  import jax
  import numpy as np
  from noloco_jax.inner import step as inner
  from noloco_jax.training import build as build_lib
  from noloco_jax.parallel import sharding as sharding_lib

  cfg = bench.config()
  cfg.num_replicas = args.replicas
  cfg.outer.kind = "none"  # only the inner step is measured
  bench.override(cfg)

  setup = build_lib.build(cfg, vocab_size=257)
  n = cfg.num_replicas
  rng = np.random.default_rng(0)
  batches = rng.integers(0, 257, size=(n, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
  global_batch = sharding_lib.global_array(setup.mesh, batches, n)
  state = setup.init_state()

  optimizer = inner.make_optimizer(cfg.inner, cfg.num_steps)

  @jax.jit
  def single_step(s, b):
    loss, grads = inner.compute_grads(s.params, b, setup.model.loss)
    return inner.apply_grads(s, grads, optimizer), loss

  device = jax.devices()[0]
  singles = [jax.device_put(jax.tree.map(lambda x: np.asarray(x)[r], state), device) for r in range(n)]
  single_batches = [jax.device_put(batches[r], device) for r in range(n)]

  def run_mapped(state):
    for _ in range(args.steps):
      state, metrics = setup.inner_step(state, global_batch)
    jax.block_until_ready(metrics)
    return state

  def run_sequential(singles):
    for _ in range(args.steps):
      out = [single_step(s, b) for s, b in zip(singles, single_batches)]
      singles = [s for s, _ in out]
    jax.block_until_ready(out)
    return singles

  state = run_mapped(state)  # compile and warm up both sides
  singles = run_sequential(singles)
  ratios, mapped_s, sequential_s = [], [], []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    state = run_mapped(state)
    t1 = time.perf_counter()
    singles = run_sequential(singles)
    t2 = time.perf_counter()
    mapped_s.append((t1 - t0) / args.steps)
    sequential_s.append((t2 - t1) / args.steps)
    ratios.append((t2 - t1) / (t1 - t0))

  tokens = n * cfg.data.batch_size * cfg.data.seq_len
  result = {
      "benchmark": "bench_inner",
      "replicas": n,
      "devices": int(setup.mesh.devices.size),
      "platform": jax.devices()[0].platform,
      "model": cfg.model.preset,
      "num_params": setup.model.num_params(),
      "batch_per_replica": cfg.data.batch_size,
      "seq_len": cfg.data.seq_len,
      "mapped_step_s": statistics.median(mapped_s),
      "sequential_step_s": statistics.median(sequential_s),
      "mapped_tokens_per_s": tokens / statistics.median(mapped_s),
      "sequential_tokens_per_s": tokens / statistics.median(sequential_s),
      "ratio_median": statistics.median(ratios),
      "ratios": ratios,
  }
  return bench.finish(result, text=lambda r: f"mapped {r['mapped_step_s'] * 1e3:.1f} ms/step, sequential "
                      f"{r['sequential_step_s'] * 1e3:.1f} ms/step, throughput ratio mapped/sequential = "
                      f"{r['ratio_median']:.3f}")


if __name__ == "__main__":
  harness.run(main)
