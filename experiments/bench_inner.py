"""Inner-step throughput of the replica mesh against a plain single-replica step, as a ratio.

Compares, for the same model and per-replica batch:
  mapped:     one call of the jitted shard_map'd inner step that advances all N replicas (N devices);
  sequential: N calls of a plain jitted single-replica step (no mesh, no vmap, no shard_map) on one device.
ratio = throughput(mapped) / throughput(sequential) = time(sequential) / time(mapped). The two are
timed alternately in the same process, several times, and the median ratio is reported, so that
machine noise hits both sides alike.

    python experiments/bench_inner.py --json                       # default config, 8 replicas
    python experiments/bench_inner.py --steps=20 --config_arg=smoke --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--replicas", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
  parser.add_argument("--repeats", type=int, default=5, help="alternating repetitions of both sides")
  parser.add_argument("--config_arg", default="", help="argument string for configs/default.py, e.g. smoke")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="config override, e.g. --set model.num_layers=4 (repeatable)")
  parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
  args = parser.parse_args(argv)

  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.replicas))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  import jax
  import numpy as np
  from configs import default
  from experiments.lib import experiment
  from noloco_jax.inner import step as inner
  from noloco_jax.parallel import mesh as mesh_lib
  from noloco_jax.parallel import sharding as sharding_lib
  from noloco_jax.training import build as build_lib

  cfg = default.get_config(args.config_arg or None)
  cfg.num_replicas = args.replicas
  cfg.outer.kind = "none"  # only the inner step is measured
  experiment.apply_overrides(cfg, args.set)

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
  if not args.json:
    print(f"mapped {result['mapped_step_s'] * 1e3:.1f} ms/step, sequential {result['sequential_step_s'] * 1e3:.1f} "
          f"ms/step, throughput ratio mapped/sequential = {result['ratio_median']:.3f}")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
