"""Cost of the per-replica state checksum stored in every checkpoint (noloco_jax/io/checkpoint/checksum.py).

    python experiments/bench_checksum.py      # prints one JSON line per config

Times `checksum.state_checksums` (one jitted reduction over the whole replica-stacked state and a
replicated [N, 2] result) on the smoke and the default config, after a first call that compiles.
"""

import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from noloco_jax.io.checkpoint import checksum  # noqa: E402
from noloco_jax.training import build as build_lib  # noqa: E402


def main():
  for arg in ("smoke", None):
    setup = build_lib.build(default.get_config(arg))
    state = setup.init_state()
    checksum.state_checksums(state, setup.mesh)  # compiles
    times = []
    for _ in range(5):
      start = time.perf_counter()
      checksum.state_checksums(state, setup.mesh)
      times.append(time.perf_counter() - start)
    print(json.dumps({"config": arg or "default", "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
                      "checksum_s_median": float(np.median(times))}))


if __name__ == "__main__":
  main()
