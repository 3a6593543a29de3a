"""Bytes per replica per round of each message setting, relative to float32 dense (docs/compression.md).

For the model of the mini setting (experiments/lib/experiment.py; or --preset), prints one JSON line
per setting (with --json, one object holding them all): the counted bytes (method.bytes_per_round,
from the payload shapes) and, with --hlo, the operand bytes of the collective-permutes in the compiled
round (8 fake CPU devices, one replica each), which must be equal. bfloat16 messages are widened to float32 by XLA:CPU after lowering (tools/hlo.py),
so their compiled figure is not compared.

    python experiments/bench_compression.py [--hlo] [--preset tiny] [--json]
"""

from __future__ import annotations

import json

from experiments.lib import harness

SETTINGS = {
    "float32": {},
    "bfloat16": dict(message_dtype="bfloat16"),
    "int8": dict(compression="int8"),
    "int4": dict(compression="int4"),
    "topk 1% 2-bit, slow int8": dict(compression="topk", topk_density=0.01, topk_bits=2, slow_codec="int8"),
    "topk 3% 2-bit, slow int8": dict(compression="topk", topk_density=0.03, topk_bits=2, slow_codec="int8"),
    "topk 1% 2-bit, slow int4": dict(compression="topk", topk_density=0.01, topk_bits=2, slow_codec="int4"),
}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True)
  bench.add_argument("--hlo", action="store_true", help="also compile each round and read its collectives")
  bench.add_argument("--preset", default="", help="model.preset instead of the mini model")
  args = bench.parse(argv)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.lib import experiment  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import pairing, programs as programs_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top

  base = experiment.base_config()
  if args.preset:
    base.model.preset = args.preset
    base.model.d_model = base.model.num_layers = base.model.num_heads = base.model.mlp_dim = 0
  dense, rows = None, []
  for name, outer in SETTINGS.items():
    config = experiment.method_config(base, "noloco", **outer)
    setup = build_lib.build(config, vocab_size=257)
    state = jax.eval_shape(setup.init_state)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
    counted = setup.method.traffic(one, setup.config.num_replicas)[0].operand
    dense = dense or counted
    row = {"setting": name, "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(one))),
           "bytes_per_round": counted, "vs_float32": round(counted / dense, 5)}
    if args.hlo:
      mesh = mesh_lib.make_mesh(config.num_replicas, config.num_replicas)
      groups = pairing.groups_from_permutation(np.arange(config.num_replicas), config.outer.rule.group_size)
      shardings = jax.tree.map(lambda _: mesh_lib.replica_sharding(mesh), state)
      lowered = programs_lib.make_round_fn(setup.method, mesh, (groups,)).lower(
          jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings), jnp.int32(0))
      row["compiled_permute_bytes"] = hlo_lib.collective_bytes(lowered.compile().as_text(), "collective-permute")
      row["compiled_equals_counted"] = None if name == "bfloat16" else row["compiled_permute_bytes"] == counted
    rows.append(row)
  return bench.finish({"settings": rows}, text=lambda r: "\n".join(json.dumps(row) for row in r["settings"]))


if __name__ == "__main__":
  harness.run(main)
