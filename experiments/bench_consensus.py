"""Cost of the consensus model's evaluation (noloco_jax/training/plugins/consensus_eval.py) beside the loop's own.

    python experiments/bench_consensus.py            # one JSON line per config (--json: one object)

At every evaluation the loop scores each of the N replicas on the validation batches
(`training.evaluate`: eval/loss, eval/ppl, replicas/weight_std); the plug-in adds one model, the
replicas' mean of φ (one all-reduce of the model, then one evaluation). Both are timed after a first
call that compiles, alternating, `--repeats` times each, on the smoke and the default config.
"""

import json
import time
import types

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True, quick={"configs": "smoke", "repeats": 2})
  bench.add_argument("--configs", default="smoke,default", help="comma-separated configs/default.py arguments")
  bench.add_argument("--repeats", type=int, default=5, help="timed calls of each, alternating")
  args = bench.parse(argv)
  import jax  # pylint: disable=g-import-not-at-top  (after the harness set the devices)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from configs import default  # pylint: disable=g-import-not-at-top
  from noloco_jax import training  # pylint: disable=g-import-not-at-top
  from noloco_jax.io import data as data_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training.plugins import consensus_eval  # pylint: disable=g-import-not-at-top

  rows = []
  for name in args.configs.split(","):
    setup = build_lib.build(default.get_config(None if name == "default" else name))
    state = setup.init_state()
    batches = jax.device_put(data_lib.make_eval_batches(setup.config.data, seed=0, vocab_size=setup.model.vocab_size),
                             mesh_lib.replicated(setup.mesh))
    run = types.SimpleNamespace(setup=setup, state=state, eval_batches=batches, writer=None,
                                loop=types.SimpleNamespace(resumed=True))  # resumed: start() evaluates nothing
    plugin = consensus_eval.ConsensusEval()
    plugin.start(run)
    training.evaluate(setup, state, batches)  # compiles
    plugin.evaluate(run)  # compiles
    loop_s, consensus_s = [], []
    for _ in range(args.repeats):
      start = time.perf_counter()
      training.evaluate(setup, state, batches)
      loop_s.append(time.perf_counter() - start)
      start = time.perf_counter()
      plugin.evaluate(run)
      consensus_s.append(time.perf_counter() - start)
    rows.append({"config": name, "num_replicas": setup.config.num_replicas, "eval_batches": int(batches.shape[0]),
                 "loop_evaluate_s_median": float(np.median(loop_s)),
                 "consensus_evaluate_s_median": float(np.median(consensus_s)),
                 "ratio": float(np.median(consensus_s) / np.median(loop_s))})
  return bench.finish({"configs": rows}, text=lambda r: "\n".join(json.dumps(row) for row in r["configs"]))


if __name__ == "__main__":
  harness.run(main)
