"""NoLoCo's message codecs (docs/compression.md): bytes per round against float32, and what they cost in training.

Three parts, each one JSON object (the last line with --json):

- bytes (the default): for the model of the mini setting (experiments/lib/experiment.py; or --preset MODEL),
  the counted bytes per replica per round of each setting (method.traffic, from the payload shapes) and,
  with --hlo, the operand bytes of the collective-permutes in the compiled round (8 fake CPU devices, one
  replica each), which must be equal. bfloat16 messages are widened to float32 by XLA:CPU after lowering
  (tools/hlo.py), so their compiled figure is not compared.

      python experiments/bench_compression.py [--hlo] [--preset tiny] [--json]

- --train: trains each setting of TRAIN on the default job (configs/default.py: 8 replicas, tiny, 500
  steps, H = 50) for every seed of --seeds and prints {"settings": [{"setting", "vs_float32",
  "eval_loss", "loss_vs_float32", "consensus_loss", "weight_std", "seeds": [...]}, ...]}: means over
  seeds, each seed's values (with its curve of replicas/weight_std, and its loss over float32's of the same
  seed; `loss_vs_float32_same_seeds` their mean) too. vs_float32 is the counted bytes per
  round of the trained model over float32's (checked against the compiled collectives with --hlo);
  each run's comm/bytes_sent_per_replica per round is kept beside it. `no exchange` (outer.kind=none:
  independent replicas, 0 bytes) is the reference of what exchanging buys. --plot PATH draws the loss (÷
  float32's of the same seeds) and the final spread against vs_float32 (Pareto front).

      python experiments/bench_compression.py --train --json [--seeds 0,1] [--settings NAME,...] [--out FILE]

  --preset MODEL trains the same job (8 replicas, 500 steps, H = 50, the same data) with another model: a
  model.preset (tiny, small, medium, large: noloco_jax/config/model.py) or a size of MODELS between tiny and
  small; the result's "job" names it (--merge joins only results of one job).

  --merge A.json,B.json joins --train results of one job (other seeds or other settings, trained side by
  side) into one, with the means recomputed; --plot draws it.

  With fragment streaming (STREAMED: "float32 F=5", ...) a row also gives `peak_bytes_per_step`: the bytes of
  the largest fragment's round (one round every H/F steps), against the whole round's without streaming
  (counted; with --hlo, also each fragment's compiled round, `compiled_fragment_bytes`).

- --capture: how much of the partners' difference D = c_j − c_i a coset code delivers (the capture
  1 − ms(ĉ_j − c_j) / ms(D), outer/coset.py's encode and decode with a shared dither), on the default
  job's own messages after --steps inner steps: per leaf rms(c), rms(D) and its slow / fresh parts, and
  for b = 1…4 bits the best κ = ε / rms(D) of a grid, per leaf and per block of 256 values (what
  coset.DEFAULT_KAPPA was chosen from).

      python experiments/bench_compression.py --capture [--steps 449] [--json]
"""

from __future__ import annotations

import json
import os
import time

from experiments.lib import harness

COSET = dict(compression="coset", coset_bits=2, coset_order="cyclic")
# Names hold no commas (--settings is a comma-separated list of them). "topk d% b-bit + C": the fresh part
# β·(θ − φ) top-k at density d with b-bit values, the γ·φ part in codec C.
SETTINGS = {
    "float32": {},
    "bfloat16": dict(message_dtype="bfloat16"),
    "int8": dict(compression="int8"),
    "int4": dict(compression="int4"),
    "topk 1% 2-bit + int8": dict(compression="topk", topk_density=0.01, topk_bits=2, slow_codec="int8"),
    "topk 3% 2-bit + int8": dict(compression="topk", topk_density=0.03, topk_bits=2, slow_codec="int8"),
    "topk 1% 2-bit + int4": dict(compression="topk", topk_density=0.01, topk_bits=2, slow_codec="int4"),
    # The whole message in 2-bit coset codes against the receiver's own, on a shared cyclic fragment.
    "coset 30% 2-bit": dict(COSET, coset_density=0.3),
    "coset 15% 2-bit": dict(COSET, coset_density=0.15),
    "coset 100% 2-bit": dict(COSET, coset_density=1.0),
    # The same bytes in more bits on fewer blocks (a wider code range, less dither noise): ~1.9 % of float32.
    "coset 20% 3-bit": dict(COSET, coset_density=0.2, coset_bits=3),
    "coset 15% 4-bit": dict(COSET, coset_density=0.15, coset_bits=4),
    # ... with one lattice step per block (an int8 exponent each) at κ = 1: D's heavy tail is mostly
    # between blocks, so a per-leaf step both wraps the wide blocks and buries the narrow ones in dither.
    "coset 15% 4-bit block": dict(COSET, coset_density=0.15, coset_bits=4, coset_scale="block", coset_kappa=1.0),
    # Controls: the fragment's values as they are (no code: what the fragment alone costs), every value coded.
    "coset 15% float32": dict(COSET, coset_density=0.15, coset_bits=32),
    "coset 1% float32": dict(COSET, coset_density=0.01, coset_bits=32),  # ~ the local outer step alone
    "coset 100% 4-bit": dict(COSET, coset_density=1.0, coset_bits=4),
    "coset 50% 4-bit": dict(COSET, coset_density=0.5, coset_bits=4),  # 6.25 %, as 100% 2-bit
    # Every value every round: each group of 1/density values as one signed sum (a random projection of D).
    "coset sum 1/4 2-bit": dict(COSET, coset_density=0.25, coset_mode="sum"),
    # Off the fragment (coset_rest): no outer step there (keep: θ as trained, φ ← θ), or the anchor kept (anchor:
    # the pseudo-gradient grows until the value is next in a fragment) instead of the local outer step.
    "coset 30% 2-bit keep": dict(COSET, coset_density=0.3, coset_rest="keep"),
    "coset 30% 2-bit anchor": dict(COSET, coset_density=0.3, coset_rest="anchor"),
    "coset 15% 2-bit keep": dict(COSET, coset_density=0.15, coset_rest="keep"),
    "coset 15% 2-bit anchor": dict(COSET, coset_density=0.15, coset_rest="anchor"),
    # Plain averaging of the fragment's θ and nothing elsewhere: gossip (α = 0, β = γ = 1: c = θ) with keep.
    "gossip coset 30% 2-bit keep": dict(COSET, coset_density=0.3, coset_rest="keep"),
    "gossip coset 15% 2-bit keep": dict(COSET, coset_density=0.15, coset_rest="keep"),
    "gossip coset sum 1/4 2-bit": dict(COSET, coset_density=0.25, coset_mode="sum"),  # every value, projected
}
KINDS = {"gossip coset 30% 2-bit keep": "gossip", "gossip coset 15% 2-bit keep": "gossip",  # outer.kind if not noloco
         "gossip coset sum 1/4 2-bit": "gossip"}
# Fragment streaming (outer.streaming.*, docs/compression.md): a codec of SETTINGS, its message in F fragments,
# one every H/F steps; "own": each fragment round with a partner of its own.
STREAMED = {
    "float32 F=2": ("float32", dict(fragments=2)),
    "float32 F=5": ("float32", dict(fragments=5)),
    "float32 F=5 own": ("float32", dict(fragments=5, partners="own")),
    "int8 F=5": ("int8", dict(fragments=5)),
}
# --preset: model sizes between the default job's tiny (2 layers of width 128, 492,416 parameters) and small
# (125M), as d_model / num_layers / num_heads / mlp_dim (the rest: the tiny preset's). The parameter counts are
# with the byte tokenizer's 257 tokens.
MODELS = {
    "1m": dict(d_model=128, num_layers=5, num_heads=4, mlp_dim=384),  # 1,132,160 parameters: bench_network's model
}
NO_EXCHANGE = "no exchange"  # outer.kind=none: independent replicas (--train only)
TRAIN = ("float32", "bfloat16", "int8", "int4", "topk 1% 2-bit + int8", "coset 30% 2-bit", "coset 15% 2-bit",
         NO_EXCHANGE)
KAPPAS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0, 2.5, 3.0)  # --capture's grid
PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7), (1, 2), (3, 6))  # --capture's pairs of replicas


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True, out=True,
                        quick={"seeds": "0", "settings": "float32,coset 30% 2-bit", "steps": 12},
                        quick_help="--train / --capture on the smoke job, one seed, float32 and coset 30%%")
  bench.add_argument("--hlo", action="store_true", help="also compile each round and read its collectives")
  bench.add_argument("--preset", default="", help="a model.preset or a size of MODELS (1m, ...): bytes: instead "
                     "of the mini model; --train: instead of the default job's tiny")
  bench.add_argument("--train", action="store_true", help="train each setting on the default job (--preset: its model)")
  bench.add_argument("--capture", action="store_true", help="the coset codes' capture on the default job's messages")
  bench.add_argument("--seeds", default="0,1", help="--train: comma-separated seeds")
  bench.add_argument("--settings", default=",".join(TRAIN), help="--train: comma-separated names of SETTINGS")
  bench.add_argument("--steps", type=int, default=449, help="--capture: inner steps to train before looking")
  bench.add_argument("--plot", default="", help="--train: write the Pareto plot (loss and spread vs bytes) here")
  bench.add_argument("--merge", default="", help="comma-separated --train result files to join (other seeds)")
  args = bench.parse(argv)
  if args.train + args.capture + bool(args.merge) > 1:
    harness.usage_error("--train, --capture, --merge: choose one part")
  from noloco_jax.config.model import PRESETS  # pylint: disable=g-import-not-at-top  (after the devices are set)
  if args.preset and args.preset not in (*PRESETS, *MODELS):
    harness.usage_error(f"--preset={args.preset!r} is not a model: one of {', '.join([*PRESETS, *MODELS])}")
  if args.preset and (args.capture or args.merge):
    harness.usage_error("--preset: for the bytes part and --train only")
  if args.merge:
    parts = []
    for path in args.merge.split(","):
      try:
        with open(path) as f:
          parts.append(json.load(f))
      except (OSError, ValueError) as e:
        harness.usage_error(f"--merge: {path!r} is not a readable --train result ({e})")
    result = merge(parts)
    if args.plot:
      plot(result, args.plot)
    return bench.finish(result, text=lambda r: "\n".join(json.dumps({k: v for k, v in s.items() if k != "seeds"})
                                                         for s in r["settings"]))
  if args.train:
    names = [n for n in args.settings.split(",") if n]
    for name in names:
      if name not in SETTINGS and name not in STREAMED and name != NO_EXCHANGE:
        harness.usage_error(f"--settings: {name!r} is not one of {', '.join([*SETTINGS, *STREAMED, NO_EXCHANGE])}")
    try:
      seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
      harness.usage_error(f"--seeds={args.seeds!r}: comma-separated integers, e.g. 0,1")
    result = train(names, seeds, quick=args.quick, hlo=args.hlo, note=bench.note, save=args.out or None,
                   preset=args.preset)
    if args.plot:
      plot(result, args.plot)
    return bench.finish(result, text=lambda r: "\n".join(json.dumps({k: v for k, v in s.items() if k != "seeds"})
                                                         for s in r["settings"]))
  if args.capture:
    result = capture(args.steps, quick=args.quick)
    return bench.finish(result, text=lambda r: "\n".join(json.dumps(x) for x in r["leaves"] + r["capture"]))
  rows = message_bytes(args.preset, args.hlo)
  return bench.finish({"settings": rows}, text=lambda r: "\n".join(json.dumps(row) for row in r["settings"]))


def _bytes(config, hlo: bool) -> dict:
  """Counted bytes per replica per round of `config`'s method (and, with `hlo`, the compiled round's
  collective-permute operand bytes on N fake devices, one replica each)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import pairing, programs as programs_lib, streaming  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top

  setup = build_lib.build(config, vocab_size=257)
  state = jax.eval_shape(setup.init_state)
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  n = setup.config.num_replicas
  row = {"params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(one))),
         "bytes_per_round": setup.method.traffic(one, n)[0].operand}
  # Each fragment's method (the whole message's without streaming): its round's bytes, the peak per step.
  methods = ([streaming.fragment_method(setup.method, f) for f in setup.fragments] if setup.fragments else
             [setup.method])
  row["fragment_bytes"] = [m.traffic(one, n)[0].operand for m in methods]
  row["bytes_per_round"] = sum(row["fragment_bytes"])
  row["peak_bytes_per_step"] = max(row["fragment_bytes"])
  if hlo and setup.method.has_rounds:
    mesh = mesh_lib.make_mesh(config.num_replicas, config.num_replicas)
    groups = pairing.groups_from_permutation(np.arange(config.num_replicas), setup.config.outer.rule.group_size)
    shardings = jax.tree.map(lambda _: mesh_lib.replica_sharding(mesh), state)
    compiled = [hlo_lib.collective_bytes(programs_lib.make_round_fn(m, mesh, (groups,)).lower(
        jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings),
        jnp.int32(0)).compile().as_text(), "collective-permute") for m in methods]
    row["compiled_permute_bytes"] = sum(compiled)
    if setup.fragments:
      row["compiled_fragment_bytes"] = compiled
  return row


def set_model(config, preset: str) -> None:
  """`config.model` at `preset` (nothing if ''): a model.preset with its own sizes (the job's size overrides
  cleared), or a size of MODELS."""
  from noloco_jax.config.model import SIZE_FIELDS  # pylint: disable=g-import-not-at-top
  if preset in MODELS:
    config.model.preset = "tiny"
    config.model.update(MODELS[preset])
  elif preset:
    config.model.preset = preset
    for name in SIZE_FIELDS:
      config.model[name] = 0  # 0: the preset's


def message_bytes(preset: str, hlo: bool) -> list[dict]:
  """The bytes part: every setting on the mini model (or `preset`)."""
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top

  base = experiment.base_config()
  set_model(base, preset)
  dense, rows = None, []
  for name in [*SETTINGS, *STREAMED]:
    config = experiment.method_config(base, KINDS.get(name, "noloco"), codec=SETTINGS[STREAMED[name][0] if name in STREAMED else name])
    if name in STREAMED:  # at the default job's H = 50, which every F of STREAMED divides (bytes do not depend on H)
      config.outer.inner_steps = 50
      config.outer.streaming.update(STREAMED[name][1])
    row = {"setting": name, **_bytes(config, hlo)}
    dense = dense or row["bytes_per_round"]
    row["vs_float32"] = round(row["bytes_per_round"] / dense, 5)
    if hlo:
      row["compiled_equals_counted"] = None if name == "bfloat16" else row["compiled_permute_bytes"] == row["bytes_per_round"]
    rows.append(row)
  return rows


def train(names, seeds, *, quick: bool, hlo: bool, note, save: str | None = None, preset: str = "") -> dict:
  """The --train part: each setting on the default job (the smoke job with `quick`), every seed; `preset`:
  with that model (set_model). `save`: a file the results so far are written to after every run (an
  interrupted sweep keeps what it ran)."""
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top

  experiment.enable_compile_cache()
  job = ("smoke" if quick else "default") + (f", model {preset}" if preset else "")
  out = []
  for name in names:
    per_seed, counted = [], None
    for seed in seeds:
      config = experiment.load_default_config("smoke" if quick else None)
      set_model(config, preset)
      config.seed = seed
      if name == NO_EXCHANGE:
        config.outer.kind = "none"
      else:
        config.outer.kind = KINDS.get(name, config.outer.kind)
        config.outer.codec.update(SETTINGS[STREAMED[name][0] if name in STREAMED else name])
        if name in STREAMED:
          config.outer.streaming.update(STREAMED[name][1])
        config.outer.codec.coset_seed = seed  # the pair's shared randomness, new with each seed
      if counted is None:
        counted = _bytes(config, hlo)
      load = os.getloadavg()[0]
      start = time.time()
      run = experiment.run(config, label=name)
      rounds = max(1, config.num_steps // run.config.outer.inner_steps)
      row = {"seed": seed, "eval_loss": run.final["eval/loss"], "consensus_loss": run.final.get("eval/consensus_loss"),
             "weight_std": run.final["replicas/weight_std"],
             "bytes_sent_per_round": run.final.get("comm/bytes_sent_per_replica", 0.0) / rounds,
             "weight_std_curve": [(e["step"], e.get("replicas/weight_std")) for e in run.eval],
             "wall_s": round(time.time() - start, 1), "load_start": round(load, 1),
             "load_end": round(os.getloadavg()[0], 1), "error": run.error}
      note(json.dumps({"setting": name, **{k: row[k] for k in ("seed", "eval_loss", "weight_std", "wall_s")}}))
      per_seed.append(row)
      if save:
        with open(save, "w") as f:
          json.dump(summarise({"job": job, "seeds": seeds,
                               "settings": [*out, {"setting": name, **counted, "seeds": per_seed}]}), f, indent=1)
    out.append({"setting": name, **counted, "seeds": per_seed})
  return summarise({"job": job, "seeds": seeds, "settings": out})


def summarise(result: dict) -> dict:
  """Each setting's means over its seeds, and its bytes and loss relative to float32's."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  float32 = None
  for entry in result["settings"]:
    per_seed = entry["seeds"]
    for key in ("eval_loss", "consensus_loss", "weight_std"):
      values = [r[key] for r in per_seed]
      entry[key] = float(np.mean(values)) if all(v is not None for v in values) else None
    if entry["setting"] == "float32":
      float32 = entry
  same_seed = {r["seed"]: r["eval_loss"] for r in float32["seeds"]} if float32 else {}
  for entry in result["settings"]:
    entry["vs_float32"] = entry["bytes_per_round"] / float32["bytes_per_round"] if float32 else None
    entry["loss_vs_float32"] = entry["eval_loss"] / float32["eval_loss"] if float32 else None
    # Each seed against float32's run of the same seed (the seeds' losses differ by more than most settings).
    for row in entry["seeds"]:
      row["loss_vs_float32"] = row["eval_loss"] / same_seed[row["seed"]] if row["seed"] in same_seed else None
    paired = [row["loss_vs_float32"] for row in entry["seeds"]]
    entry["loss_vs_float32_same_seeds"] = float(np.mean(paired)) if paired and None not in paired else None
  return result


def merge(parts: list[dict]) -> dict:
  """--train results of one job, joined by setting (runs of the same setting over other seeds, or other
  settings), in the order of SETTINGS; `summarise`d again. A setting's seed found in two parts (the same run,
  e.g. float32 saved beside each part) is taken once, from the first."""
  if len({part["job"] for part in parts}) != 1:
    harness.usage_error("--merge: the results are of different jobs")
  by_name: dict[str, dict] = {}
  for part in parts:
    for s in part["settings"]:
      entry = by_name.setdefault(s["setting"], {k: v for k, v in s.items() if k not in (
          "eval_loss", "consensus_loss", "weight_std", "vs_float32", "loss_vs_float32", "seeds")} | {"seeds": []})
      have = {row["seed"] for row in entry["seeds"]}  # a run saved in two files (float32 beside each part) once
      entry["seeds"] += [row for row in s["seeds"] if row["seed"] not in have]
  order = [*SETTINGS, *STREAMED, NO_EXCHANGE]
  settings = sorted(by_name.values(), key=lambda s: order.index(s["setting"]) if s["setting"] in order else len(order))
  seeds = sorted({row["seed"] for s in settings for row in s["seeds"]})
  return summarise({"job": parts[0]["job"], "seeds": seeds, "settings": settings,
                    "runs_machine": [part.get("machine") for part in parts]})


def plot(result: dict, path: str) -> None:
  """eval/loss (÷ float32's of the same seeds) and the final replicas/weight_std against bytes per round /
  float32 (log), one point per setting (means over seeds), the Pareto front of the loss drawn through the
  points no cheaper one beats."""
  from experiments.lib import plots  # pylint: disable=g-import-not-at-top  (matplotlib: the `plots` extra)
  del plots
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = sorted(result["settings"], key=lambda s: s["vs_float32"])
  color = {s["setting"]: f"C{i}" for i, s in enumerate(result["settings"])}  # one colour per setting, every panel
  fig, axes = plt.subplots(1, 3, figsize=(18, 6))
  floor = min([s["vs_float32"] for s in rows if s["vs_float32"] > 0] or [1.0]) / 4  # 0 bytes on a log axis
  x = lambda s: max(s["vs_float32"], floor)
  # The loss against float32's run of the same seed where every seed has one (settings run at one seed are then
  # not measured against a two-seed mean), else the loss itself.
  paired = all(s.get("loss_vs_float32_same_seeds") is not None for s in rows)
  loss_key, loss_label = (("loss_vs_float32_same_seeds", "final eval/loss ÷ float32's (same seeds)") if paired
                          else ("eval_loss", "final eval/loss"))
  for ax, key, label in ((axes[0], loss_key, loss_label), (axes[1], "weight_std", "final replicas/weight_std")):
    for s in rows:
      ax.scatter(x(s), s[key], s=25, color=color[s["setting"]])
      ax.annotate(s["setting"], (x(s), s[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front, best = [], float("inf")
    for s in rows:
      if s[key] < best:
        front.append(s)
        best = s[key]
    ax.plot([x(s) for s in front], [s[key] for s in front], "k--", lw=0.8, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel(f"bytes per round / float32 (0 bytes drawn at {floor:.4f})")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  for s in result["settings"]:  # the spread over the run, mean over seeds
    curves = [dict(r["weight_std_curve"]) for r in s["seeds"]]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    axes[2].plot(steps, [sum(c[t] for c in curves) / len(curves) for t in steps], marker=".", label=s["setting"],
                 color=color[s["setting"]])
  axes[2].set_yscale("symlog", linthresh=1e-4)
  axes[2].set_xlabel("inner step")
  axes[2].set_ylabel("replicas/weight_std (mean over seeds)")
  axes[2].grid(alpha=0.3)
  axes[2].legend(fontsize=6, ncol=2)
  fig.suptitle(f"NoLoCo message codecs, {result['job']} job, seeds {result['seeds']} (means)", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def capture(steps: int, *, quick: bool) -> dict:
  """The --capture part (module docstring)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top
  from noloco_jax.config.outer import OuterConfig  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import coset  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import loop  # pylint: disable=g-import-not-at-top

  config = experiment.load_default_config("smoke" if quick else None)
  config.num_steps, config.eval_every = steps, 0
  with tempfile.TemporaryDirectory() as workdir:
    state = loop.train_and_evaluate(config, workdir)["state"]
  rule = OuterConfig.parse(config.outer).rule
  beta, gamma = rule.outer_lr, rule.consensus_weight
  names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.params)]
  thetas = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
  phis = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.outer["slow"])]
  rng = np.random.default_rng(0)
  leaves, pairs_c, pairs_d = [], [], []
  for name, theta, phi in zip(names, thetas, phis):
    c = (np.float32(beta) * theta + np.float32(gamma - beta) * phi).reshape(theta.shape[0], -1)
    d = np.stack([c[j] - c[i] for i, j in PAIRS]).astype(np.float64)
    slow = np.stack([gamma * (phi[j] - phi[i]).ravel() for i, j in PAIRS])
    fresh = np.stack([beta * ((theta[j] - phi[j]) - (theta[i] - phi[i])).ravel() for i, j in PAIRS])
    rms = float(np.sqrt(np.mean(d ** 2)))
    leaves.append({"leaf": name, "values": int(c.shape[1]), "rms_c": float(np.sqrt(np.mean(c.astype(np.float64) ** 2))),
                   "rms_D": rms, "rms_D_slow": float(np.sqrt(np.mean(slow ** 2))),
                   "rms_D_fresh": float(np.sqrt(np.mean(fresh ** 2))),
                   "rms_progress": float(np.sqrt(np.mean((beta * (theta - phi).astype(np.float64)) ** 2))),
                   "kurtosis_D": float(np.mean((d / max(rms, 1e-30)) ** 4)),
                   "beyond_3rms": float(np.mean(np.abs(d) > 3 * rms))})
    pairs_c.append(c)
    pairs_d.append(d)

  def captured(bits, kappa, per_block):
    lost = total = 0.0
    for c, d in zip(pairs_c, pairs_d):
      for p, (i, j) in enumerate(PAIRS):
        D = d[p]
        if per_block:
          blocks = np.pad(D, (0, -D.size % 256)).reshape(-1, 256)
          scale = np.repeat(np.sqrt(np.mean(blocks ** 2, axis=1)), 256)[:D.size]
        else:
          scale = np.full(D.size, np.sqrt(np.mean(D ** 2)))
        eps = np.maximum(kappa * scale, 1e-30).astype(np.float32)
        u = rng.uniform(-0.5, 0.5, D.size).astype(np.float32)
        decoded = np.asarray(coset.coset_decode(coset.coset_encode(c[j], eps, u, bits), c[i], eps, u, bits))
        lost += float(np.sum((decoded.astype(np.float64) - c[j]) ** 2))
        total += float(np.sum(D ** 2))
    return 1.0 - lost / total

  rows = []
  for per_block in (False, True):
    for bits in (1, 2, 3, 4):
      best = max((captured(bits, k, per_block), k) for k in KAPPAS)
      rows.append({"scale": "block of 256" if per_block else "leaf", "bits": bits, "best_kappa": best[1],
                   "capture": round(best[0], 4), "capture_per_bit": round(best[0] / bits, 4)})
  return {"steps": steps, "leaves": leaves, "capture": rows}


if __name__ == "__main__":
  harness.run(main)
