"""Pipeline parallelism: inner-step throughput with 1, 2 and 4 stages, and the routing ablation.

Throughput (default): the same N replicas and per-replica batch, cut into S = 1, 2, 4 stages, each
on N × S devices (so S = 4 with N = 2 uses the 8 fake CPU devices). Each repetition times `--steps`
inner steps of every stage count in turn (alternating, so that machine noise hits all alike); the
median step time gives tokens/s and the ratio to one stage. Also printed: GPipe's bubble
(S−1)/(M+S−1) and the throughput an ideal pipeline would keep on a compute-bound machine where
every device shares the same cores (the bubble slots still compute, on ignored values): M/(M+S−1).

    python experiments/bench_pipeline.py --json
    python experiments/bench_pipeline.py --json --config.model.num_layers=8 --config.data.batch_size=8

Routing ablation (`--ablation`, docs/method.md §8): no outer steps (outer.kind=none), 2 stages ×
4 replicas, the same steps with routing random and fixed; reports the cross-replica weight std and
the validation loss of each (through training.train_and_evaluate, so the figures are the trainer's own).

    python experiments/bench_pipeline.py --ablation --json --steps=200
"""

from __future__ import annotations

import statistics
import tempfile
import time

from experiments.lib import harness


def throughput(args, bench):
  import jax
  import numpy as np
  from noloco_jax.parallel import pipeline
  from noloco_jax.parallel import sharding as sharding_lib
  from noloco_jax.training import build as build_lib
  stage_counts = [int(s) for s in args.stages.split(",")]
  setups, states, batches = {}, {}, {}
  rng = np.random.default_rng(0)
  for S in stage_counts:
    cfg = bench.config()
    cfg.num_replicas, cfg.num_devices, cfg.num_stages = args.replicas, args.replicas, S
    cfg.outer.kind = "none"  # only the inner step is measured
    cfg.model.num_layers = 4
    cfg.pipeline.routing = args.routing
    bench.override(cfg)
    setup = build_lib.build(cfg, vocab_size=257)
    n = cfg.num_replicas
    tokens = rng.integers(0, 257, size=(n, cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    setups[S], states[S], batches[S] = setup, setup.init_state(), sharding_lib.global_array(setup.mesh, tokens, n)

  def run(S):
    state = states[S]
    for _ in range(args.steps):
      state, metrics = setups[S].inner_step(state, batches[S])
    jax.block_until_ready(metrics)
    states[S] = state

  for S in stage_counts:
    run(S)  # compile and warm up
  times = {S: [] for S in stage_counts}
  for _ in range(args.repeats):
    for S in stage_counts:
      t0 = time.perf_counter()
      run(S)
      times[S].append((time.perf_counter() - t0) / args.steps)

  cfg = setups[stage_counts[0]].config
  tokens = cfg.num_replicas * cfg.data.batch_size * cfg.data.seq_len
  base = statistics.median(times[stage_counts[0]])
  rows = []
  for S in stage_counts:
    M = pipeline.num_microbatches(setups[S].config.pipeline, setups[S].config.data.batch_size)
    step_s = statistics.median(times[S])
    rows.append({"stages": S, "devices": int(setups[S].mesh.devices.size), "microbatches": M,
                 "step_s": step_s, "tokens_per_s": tokens / step_s, "ratio_to_first": base / step_s,
                 "bubble": pipeline.bubble_fraction(S, M), "ideal_ratio_shared_cores": M / (M + S - 1),
                 "step_s_all": times[S]})
  return {"benchmark": "bench_pipeline", "platform": jax.devices()[0].platform, "replicas": cfg.num_replicas,
          "routing": args.routing, "model": cfg.model.preset,
          "num_params": setups[stage_counts[0]].model.num_params(),
          "num_layers": cfg.model.num_layers, "batch_per_replica": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
          "steps": args.steps, "repeats": args.repeats, "rows": rows}


def ablation(args, bench):
  from noloco_jax import training
  results = {}
  for mode in ("random", "fixed"):
    cfg = bench.config()
    cfg.num_replicas, cfg.num_stages = 4, 2
    cfg.model.num_layers = 2
    cfg.outer.kind = "none"  # no outer steps: only the routing can bring replicas together
    cfg.pipeline.routing = mode
    cfg.num_steps = args.steps
    cfg.eval_every = max(args.steps // 4, 1)
    cfg.log_every = max(args.steps // 8, 1)
    bench.override(cfg)
    workdir = tempfile.mkdtemp(prefix=f"bench_pipeline_{mode}_")
    t0 = time.time()
    out = training.train_and_evaluate(cfg, workdir)
    results[mode] = {"eval/loss": out["eval/loss"], "eval/ppl": out["eval/ppl"],
                     "replicas/weight_std": out["replicas/weight_std"], "wall_s": time.time() - t0,
                     "evals": [{k: e[k] for k in ("step", "eval/loss", "replicas/weight_std")}
                               for e in out["history"]["eval"]]}
  r, f = results["random"], results["fixed"]
  return {"benchmark": "bench_pipeline_ablation", "steps": args.steps, "replicas": 4, "stages": 2,
          "outer": "none", "results": results,
          "weight_std_random_over_fixed": r["replicas/weight_std"] / f["replicas/weight_std"],
          "ppl_random_over_fixed": r["eval/ppl"] / f["eval/ppl"]}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=8)
  bench.add_argument("--stages", default="1,2,4", help="stage counts to compare (the first is the baseline)")
  bench.add_argument("--replicas", type=int, default=2)
  bench.add_argument("--routing", default="fixed", choices=("fixed", "random"))
  bench.add_argument("--steps", type=int, default=10, help="timed steps per repetition (ablation: training steps)")
  bench.add_argument("--repeats", type=int, default=5)
  bench.add_argument("--ablation", action="store_true", help="run the routing ablation instead")
  args = bench.parse(argv)
  if args.ablation:
    return bench.finish(ablation(args, bench), text=lambda r: "\n".join(
        f"{mode:6s}  eval/loss {m['eval/loss']:.4f}  ppl {m['eval/ppl']:.3f}  weight_std {m['replicas/weight_std']:.4e}"
        for mode, m in r["results"].items()))
  return bench.finish(throughput(args, bench), text=lambda r: "\n".join(
      f"S={row['stages']} ({row['devices']} devices, M={row['microbatches']}): "
      f"{row['step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s, ratio {row['ratio_to_first']:.3f} "
      f"(bubble {row['bubble']:.2f}, ideal on shared cores {row['ideal_ratio_shared_cores']:.3f})" for row in r["rows"]))


if __name__ == "__main__":
  harness.run(main)
