"""Cost of the consensus model's evaluation (noloco_jax/training/consensus_eval.py) beside the loop's own.

    python experiments/bench_consensus.py      # prints one JSON line per config

At every evaluation the loop scores each of the N replicas on the validation batches
(`training.evaluate`: eval/loss, eval/ppl, replicas/weight_std); the plug-in adds one model, the
replicas' mean of φ (one all-reduce of the model, then one evaluation). Both are timed after a first
call that compiles, alternating, 5 times each, on the smoke and the default config.
"""

import json
import os
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from noloco_jax import training  # noqa: E402
from noloco_jax.io import data as data_lib  # noqa: E402
from noloco_jax.parallel import mesh as mesh_lib  # noqa: E402
from noloco_jax.training import build as build_lib  # noqa: E402
from noloco_jax.training import consensus_eval  # noqa: E402


def main():
  for arg in ("smoke", None):
    setup = build_lib.build(default.get_config(arg))
    state = setup.init_state()
    batches = jax.device_put(data_lib.make_eval_batches(setup.config.data, seed=0, vocab_size=setup.model.vocab_size),
                             mesh_lib.replicated(setup.mesh))
    run = types.SimpleNamespace(setup=setup, state=state, eval_batches=batches, writer=None)
    plugin = consensus_eval.ConsensusEval()
    plugin.start(run)
    training.evaluate(setup, state, batches)  # compiles
    plugin.evaluate(run)  # compiles
    loop_s, consensus_s = [], []
    for _ in range(5):
      start = time.perf_counter()
      training.evaluate(setup, state, batches)
      loop_s.append(time.perf_counter() - start)
      start = time.perf_counter()
      plugin.evaluate(run)
      consensus_s.append(time.perf_counter() - start)
    print(json.dumps({"config": arg or "default", "num_replicas": setup.config.num_replicas,
                      "eval_batches": int(batches.shape[0]), "loop_evaluate_s_median": float(np.median(loop_s)),
                      "consensus_evaluate_s_median": float(np.median(consensus_s)),
                      "ratio": float(np.median(consensus_s) / np.median(loop_s))}))


if __name__ == "__main__":
  main()
