"""Inner-step throughput of the replica mesh against a plain single-replica step, as a ratio.

Compares, for the same model and per-replica batch:
  mapped:     one call of the jitted shard_map'd inner step that advances all N replicas (on
              config.num_devices devices; 0 = N devices, 1 = all on one device);
  sequential: N calls of a plain jitted single-replica step (no mesh, no vmap, no shard_map) on one device.
ratio = throughput(mapped) / throughput(sequential) = time(sequential) / time(mapped). The sides are
timed alternately in the same process, several times, and the median ratio is reported, so that
machine noise hits all of them alike.

When a device holds several replicas (k = N / devices > 1), the mapped step is built and timed once per
way of running them (config.inner.replica_map: `vmap` and `sequential`, inner/replicas.py), all in the
same alternation: `by_replica_map` holds each one's step time and ratio, `loop_over_vmap` the loop's
throughput over vmap's (vmap time / loop time per repetition; null when k = 1), and `mapped_*` /
`ratio_median` are those of the map the config resolves to (what a run would use, `replica_map`).

    python experiments/bench_inner.py --json                       # default config, 8 replicas on 8 devices
    python experiments/bench_inner.py --json --config.num_devices=1   # the 1-device simulator: vmap vs loop
    python experiments/bench_inner.py --steps=20 --config=configs/default.py:smoke --json
"""

from __future__ import annotations

import copy
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
  from noloco_jax.parallel import mesh as mesh_lib
  from noloco_jax.training import build as build_lib
  from noloco_jax.parallel import sharding as sharding_lib

  cfg = bench.config()
  cfg.num_replicas = args.replicas
  cfg.outer.kind = "none"  # only the inner step is measured
  bench.override(cfg)

  setup = build_lib.build(cfg, vocab_size=257)
  steps = {setup.replica_map: setup.inner_step}  # the map the config resolves to: what a run uses
  if mesh_lib.replicas_per_device(setup.mesh, cfg.num_replicas) > 1:
    for how in ("vmap", "sequential"):
      if how not in steps:
        other = copy.deepcopy(cfg)
        other.inner.replica_map = how
        steps[how] = build_lib.build(other, mesh=setup.mesh, vocab_size=257).inner_step
  n = cfg.num_replicas
  rng = np.random.default_rng(0)
  batches = rng.integers(0, 257, size=(n, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
  global_batch = sharding_lib.global_array(setup.mesh, batches, n)
  states = {how: setup.init_state() for how in steps}

  optimizer = inner.make_optimizer(cfg.inner, cfg.num_steps)

  @jax.jit
  def single_step(s, b):
    loss, grads = inner.compute_grads(s.params, b, setup.model.loss)
    return inner.apply_grads(s, grads, optimizer), loss

  device = jax.devices()[0]
  singles = [jax.device_put(jax.tree.map(lambda x: np.asarray(x)[r], states[setup.replica_map]), device) for r in range(n)]
  single_batches = [jax.device_put(batches[r], device) for r in range(n)]

  def run_mapped(how):
    state = states[how]
    for _ in range(args.steps):
      state, metrics = steps[how](state, global_batch)
    jax.block_until_ready(metrics)
    states[how] = state

  def run_sequential(singles):
    for _ in range(args.steps):
      out = [single_step(s, b) for s, b in zip(singles, single_batches)]
      singles = [s for s, _ in out]
    jax.block_until_ready(out)
    return singles

  for how in steps:  # compile and warm up every side
    run_mapped(how)
  singles = run_sequential(singles)
  mapped_s, mapped_cpu = {how: [] for how in steps}, {how: [] for how in steps}
  sequential_s, sequential_cpu = [], []
  for _ in range(args.repeats):
    for how in steps:
      t0, c0 = time.perf_counter(), time.process_time()
      run_mapped(how)
      mapped_s[how].append((time.perf_counter() - t0) / args.steps)
      mapped_cpu[how].append((time.process_time() - c0) / args.steps)
    t0, c0 = time.perf_counter(), time.process_time()
    singles = run_sequential(singles)
    sequential_s.append((time.perf_counter() - t0) / args.steps)
    sequential_cpu.append((time.process_time() - c0) / args.steps)
  # Per repetition: sequential time / mapped time, both from the same pass of the alternation. The same
  # for the process's CPU time (all its threads): the work each side did, which other jobs on a loaded
  # machine disturb less than the wall-clock time.
  ratios = {how: [q / m for q, m in zip(sequential_s, mapped_s[how])] for how in steps}
  cpu_ratios = {how: [q / m for q, m in zip(sequential_cpu, mapped_cpu[how])] for how in steps}
  # The loop against vmap directly (vmap time / loop time, same repetition): how much faster a run with
  # several replicas per device is for choosing the loop.
  loop_over_vmap = ([v / q for v, q in zip(mapped_s["vmap"], mapped_s["sequential"])]
                    if {"vmap", "sequential"} <= set(steps) else None)

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
      "replica_map": setup.replica_map,
      "mapped_step_s": statistics.median(mapped_s[setup.replica_map]),
      "sequential_step_s": statistics.median(sequential_s),
      "mapped_tokens_per_s": tokens / statistics.median(mapped_s[setup.replica_map]),
      "sequential_tokens_per_s": tokens / statistics.median(sequential_s),
      "ratio_median": statistics.median(ratios[setup.replica_map]),
      "ratios": ratios[setup.replica_map],
      "sequential_cpu_s": statistics.median(sequential_cpu),
      "by_replica_map": {how: {"step_s": statistics.median(mapped_s[how]), "ratio_median": statistics.median(ratios[how]),
                               "ratios": ratios[how], "cpu_s": statistics.median(mapped_cpu[how]),
                               "cpu_ratio_median": statistics.median(cpu_ratios[how])} for how in steps},
      "loop_over_vmap_median": statistics.median(loop_over_vmap) if loop_over_vmap else None,
      "loop_over_vmap": loop_over_vmap,
  }
  return bench.finish(result, text=lambda r: "\n".join(
      f"mapped ({how}) {m['step_s'] * 1e3:.1f} ms/step, throughput ratio mapped/sequential = {m['ratio_median']:.3f} "
      f"(CPU time ratio {m['cpu_ratio_median']:.3f})"
      for how, m in r["by_replica_map"].items()) + f"\nsequential calls {r['sequential_step_s'] * 1e3:.1f} ms/step")


if __name__ == "__main__":
  harness.run(main)
