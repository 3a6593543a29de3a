"""A/B: the inner step under two sets of config overrides, timed alternately in one process.

Both sides build the same job (--config=FILE[:ARG] with --config.FIELD=VALUE overrides), then side A
applies its --a.FIELD=VALUE overrides and side B its --b.FIELD=VALUE. Each repetition times `--steps`
steps of A then of B on the same data; the median of the per-repetition time ratios B/A is reported,
so that load on a shared machine hits both sides alike. Also the compiled step's predicted peak bytes
per device (the dry run's quantity) for each side.

    # the default job before/after issue 14 (old einsum attention vs the new default)
    python experiments/bench_ab.py --a.model.attention=einsum --b.model.attention=auto --json
    # the chunked loss against the plain one with a large vocabulary
    python experiments/bench_ab.py --config.model.vocab_size=32768 --a.model.loss_chunk=0 --b.model.loss_chunk=32 --json
"""

from __future__ import annotations

import statistics
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, groups=("a", "b"), cpu_devices=lambda args: args.replicas)
  bench.add_argument("--replicas", type=int, default=8)
  bench.add_argument("--steps", type=int, default=10, help="timed steps per side per repetition")
  bench.add_argument("--repeats", type=int, default=5)
  args = bench.parse(argv)
  import jax
  import numpy as np
  from noloco_jax.parallel import sharding as sharding_lib
  from noloco_jax.tools import dryrun
  from noloco_jax.training import build as build_lib

  sides = {}
  for name in ("a", "b"):
    cfg = bench.config()
    cfg.num_replicas = args.replicas
    cfg.outer.kind = "none"  # the inner step only
    bench.override(cfg, "config", name)
    vocab = cfg.model.vocab_size or 257
    setup = build_lib.build(cfg, vocab_size=vocab, check_data=False)
    batches = np.random.default_rng(0).integers(
        0, vocab, size=(args.replicas, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    batch = sharding_lib.global_array(setup.mesh, batches, args.replicas)
    state = setup.init_state()
    start = time.perf_counter()
    compiled = setup.inner_step.lower(state, batch).compile()
    sides[name] = {"setup": setup, "state": state, "batch": batch, "overrides": bench.overrides(name),
                   "compile_s": time.perf_counter() - start,
                   "predicted_peak_bytes": dryrun.program_memory(compiled)["peak"], "times": []}

  def run(side):
    state = side["state"]
    for _ in range(args.steps):
      state, metrics = side["setup"].inner_step(state, side["batch"])
    jax.block_until_ready(metrics)
    side["state"] = state
    side["loss"] = float(np.mean(np.asarray(metrics["loss"])))

  for side in sides.values():
    run(side)  # warm-up
  ratios = []
  for _ in range(args.repeats):
    for side in sides.values():
      t0 = time.perf_counter()
      run(side)
      side["times"].append((time.perf_counter() - t0) / args.steps)
    ratios.append(sides["b"]["times"][-1] / sides["a"]["times"][-1])

  cfg = sides["a"]["setup"].config
  result = {"benchmark": "bench_ab", "platform": jax.devices()[0].platform, "replicas": args.replicas,
            "batch_per_replica": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "common": bench.overrides(),
            "time_ratio_b_over_a_median": statistics.median(ratios), "time_ratios": ratios}
  for name, side in sides.items():
    result[name] = {"overrides": side["overrides"], "step_s": statistics.median(side["times"]),
                    "step_s_all": side["times"], "compile_s": side["compile_s"],
                    "predicted_peak_bytes": side["predicted_peak_bytes"], "last_loss": side["loss"]}
  return bench.finish(result, text=lambda r: f"A {r['a']['step_s'] * 1e3:.1f} ms/step, B {r['b']['step_s'] * 1e3:.1f} "
                                            f"ms/step, median time ratio B/A {r['time_ratio_b_over_a_median']:.3f}")


if __name__ == "__main__":
  harness.run(main)
