"""Cost of the per-replica state checksum stored in every checkpoint (noloco_jax/io/checkpoint/checksum.py).

    python experiments/bench_checksum.py      # prints one JSON line per config (--json: one object)

Times `checksum.state_checksums` (one jitted reduction over the whole replica-stacked state and a
replicated [N, 2] result) on the smoke and the default config, after a first call that compiles.
"""

import json
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_devices=8, cpu_only=True)
  bench.parse(argv)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from configs import default  # pylint: disable=g-import-not-at-top
  from noloco_jax.io.checkpoint import checksum  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top

  rows = []
  for arg in ("smoke", None):
    setup = build_lib.build(default.get_config(arg))
    state = setup.init_state()
    checksum.state_checksums(state, setup.mesh)  # compiles
    times = []
    for _ in range(5):
      start = time.perf_counter()
      checksum.state_checksums(state, setup.mesh)
      times.append(time.perf_counter() - start)
    rows.append({"config": arg or "default", "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
                 "checksum_s_median": float(np.median(times))})
  return bench.finish({"configs": rows}, text=lambda r: "\n".join(json.dumps(row) for row in r["configs"]))


if __name__ == "__main__":
  harness.run(main)
