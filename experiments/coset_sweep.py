"""Training runs of NoLoCo's message codecs (outer.compression=coset, outer/coset.py), per seed.

Trains each named setting on a base job over seeds, and prints one JSON object: per run its final
eval/loss, eval/consensus_loss, replicas/weight_std, the bytes it sent per replica and per round
(comm/bytes_sent_per_replica / rounds) relative to a float32 copy of the model, its curve of
(step, eval/loss, weight std) and the machine's load; per setting the means over seeds.

Bases: `default` (configs/default.py: 8 replicas, tiny, 500 steps, H = 50), `mini`
(experiments/lib/experiment.py: width 64, 300 steps, H = 25: the setting where independent replicas lose
2.4 % against NoLoCo, so codecs can be told apart) and `larger` (the default job with d_model 192, 4
layers, MLP 576: 2.0M parameters, the largest this 2-core machine trains in under 30 min).

    python experiments/coset_sweep.py --base mini --seeds 0,1 --settings dense,none,fisher_30 [--json] [--out FILE]
"""

from __future__ import annotations

import json
import os
import time

from experiments.lib import harness

FISHER = dict(compression="coset", coset_bits=2, coset_order="fisher")
SETTINGS = {
    "dense": {},
    "none": dict(kind="none"),
    # The whole message, 2-bit coset codes on every value (6.3 % of float32).
    "coset_2bit_all": dict(compression="coset", coset_bits=2, coset_density=1.0),
    # Fragments, 2-bit: the shared cyclic schedule, or the sender's blocks of largest Adam ν.
    "cyclic_60": dict(compression="coset", coset_bits=2, coset_density=0.6),
    "cyclic_30": dict(compression="coset", coset_bits=2, coset_density=0.3),
    "fixed_60": dict(compression="coset", coset_bits=2, coset_density=0.6, coset_order="fixed"),
    "fixed_30": dict(compression="coset", coset_bits=2, coset_density=0.3, coset_order="fixed"),
    "fixed_15": dict(compression="coset", coset_bits=2, coset_density=0.15, coset_order="fixed"),
    "fisher_30": dict(FISHER, coset_density=0.3),
    "fisher_15": dict(FISHER, coset_density=0.15),
    "mixed_30": dict(FISHER, coset_density=0.3, coset_order="mixed"),
    "damage_30": dict(FISHER, coset_density=0.3, coset_order="damage"),
    "global_30": dict(compression="coset", coset_bits=2, coset_mode="global", coset_density=0.3),
    "sum_4": dict(compression="coset", coset_bits=2, coset_mode="sum", coset_density=0.25),
    # The linear shared-subset route: a fragment's values as they are.
    "float32_fragment_30": dict(compression="coset", coset_bits=32, coset_density=0.3),
}
LARGER = dict(d_model=192, num_layers=4, num_heads=4, mlp_dim=576)


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True, out=True,
                        quick={"base": "smoke", "seeds": "0", "settings": "dense,fisher_30"})
  bench.add_argument("--base", default="mini", choices=("default", "mini", "larger", "smoke"))
  bench.add_argument("--seeds", default="0,1")
  bench.add_argument("--settings", default="dense,none,fisher_30,fisher_15")
  bench.add_argument("--workdir", default="", help="keep each run's workdir under this directory")
  args = bench.parse(argv)
  names = args.settings.split(",")
  for name in names:
    if name not in SETTINGS:
      harness.usage_error(f"--settings: {name!r} is not one of {', '.join(SETTINGS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top

  experiment.enable_compile_cache()
  runs, summary = [], []
  for name in names:
    outer = dict(SETTINGS[name])
    kind = outer.pop("kind", "noloco")
    per_seed = []
    for seed in seeds:
      if args.base == "mini":
        config = experiment.method_config(experiment.base_config(seed=seed), kind, **outer)
      else:
        config = experiment.load_default_config("smoke" if args.base == "smoke" else None)
        config.seed = seed
        config.outer.kind = kind
        config.outer.update(outer)
        if args.base == "larger":
          config.model.update(LARGER)
      workdir = os.path.join(args.workdir, f"{args.base}_{name}_s{seed}") if args.workdir else None
      load = os.getloadavg()[0]
      start = time.time()
      run = experiment.run(config, label=name, workdir=workdir)
      rounds = max(1, config.num_steps // (run.config.outer.inner_steps or 1))
      sent = run.final.get("comm/bytes_sent_per_replica", 0.0)
      float32 = 4 * _num_params(run)
      row = {"setting": name, "seed": seed, "eval_loss": run.final["eval/loss"],
             "consensus_loss": run.final.get("eval/consensus_loss"), "weight_std": run.final["replicas/weight_std"],
             "bytes_per_round": sent / rounds, "vs_float32": sent / rounds / float32,
             "curve": [(e["step"], e.get("eval/loss"), e.get("replicas/weight_std")) for e in run.eval],
             "wall_s": round(time.time() - start, 1), "load_start": round(load, 1),
             "load_end": round(os.getloadavg()[0], 1), "error": run.error}
      bench.note(json.dumps({k: row[k] for k in ("setting", "seed", "eval_loss", "weight_std", "vs_float32", "wall_s")}))
      runs.append(row)
      per_seed.append(row)
    summary.append({"setting": name, "seeds": seeds,
                    **{k: float(np.mean([r[k] for r in per_seed])) for k in ("eval_loss", "consensus_loss", "weight_std")},
                    "vs_float32": per_seed[0]["vs_float32"]})
  dense = next((s["eval_loss"] for s in summary if s["setting"] == "dense"), None)
  for s in summary:
    s["loss_vs_dense"] = s["eval_loss"] / dense if dense else None
  return bench.finish({"base": args.base, "settings": summary, "runs": runs},
                      text=lambda r: "\n".join(json.dumps(s) for s in r["settings"]))


def _num_params(run) -> int:
  """Parameters of one replica, from the run's config (the byte tokenizer's 257 symbols)."""
  import jax  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  setup = build_lib.build(run.config, vocab_size=257)
  shapes = jax.eval_shape(setup.init_state).params
  return int(sum(x.size // x.shape[0] for x in jax.tree.leaves(shapes)))


if __name__ == "__main__":
  harness.run(main)
