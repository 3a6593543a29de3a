"""A/B: the inner step under two sets of config overrides, timed alternately in one process.

Both sides build the same job (configs/default.py with --config_arg and --set), then side A applies
--a overrides and side B --b overrides. Each repetition times `--steps` steps of A then of B on the
same data; the median of the per-repetition time ratios B/A is reported, so that load on a shared
machine hits both sides alike. Also the compiled step's predicted peak bytes per device (the dry run's
quantity) for each side.

    # the default job before/after issue 14 (old einsum attention vs the new default)
    python experiments/bench_ab.py --a model.attention=einsum --b model.attention=auto --json
    # the chunked loss against the plain one with a large vocabulary
    python experiments/bench_ab.py --set model.vocab_size=32768 --a model.loss_chunk=0 --b model.loss_chunk=32 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--replicas", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per side per repetition")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--config_arg", default="", help="argument string for configs/default.py, e.g. smoke")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override for both sides")
  parser.add_argument("--a", action="append", default=[], metavar="FIELD=VALUE", help="override for side A")
  parser.add_argument("--b", action="append", default=[], metavar="FIELD=VALUE", help="override for side B")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)

  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.replicas))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  import jax
  import numpy as np
  from configs import default
  from noloco_jax.parallel import sharding as sharding_lib
  from experiments.lib import experiment
  from noloco_jax.tools import dryrun
  from noloco_jax.training import build as build_lib

  sides = {}
  for name, overrides in (("a", args.a), ("b", args.b)):
    cfg = default.get_config(args.config_arg or None)
    cfg.num_replicas = args.replicas
    cfg.outer.kind = "none"  # the inner step only
    experiment.apply_overrides(cfg, args.set + overrides)
    vocab = cfg.model.vocab_size or 257
    setup = build_lib.build(cfg, vocab_size=vocab, check_data=False)
    batches = np.random.default_rng(0).integers(
        0, vocab, size=(args.replicas, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    batch = sharding_lib.global_array(setup.mesh, batches, args.replicas)
    state = setup.init_state()
    start = time.perf_counter()
    compiled = setup.inner_step.lower(state, batch).compile()
    sides[name] = {"setup": setup, "state": state, "batch": batch, "overrides": overrides,
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
            "batch_per_replica": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "common": args.set,
            "time_ratio_b_over_a_median": statistics.median(ratios), "time_ratios": ratios}
  for name, side in sides.items():
    result[name] = {"overrides": side["overrides"], "step_s": statistics.median(side["times"]),
                    "step_s_all": side["times"], "compile_s": side["compile_s"],
                    "predicted_peak_bytes": side["predicted_peak_bytes"], "last_loss": side["loss"]}
  if not args.json:
    print(f"A {result['a']['step_s'] * 1e3:.1f} ms/step, B {result['b']['step_s'] * 1e3:.1f} ms/step, "
          f"median time ratio B/A {result['time_ratio_b_over_a_median']:.3f}")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
