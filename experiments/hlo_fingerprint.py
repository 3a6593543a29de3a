"""Fingerprint of the default job's compiled inner step: is it the same program as another checkout's?

Prints one JSON line with a hash of the optimized HLO's instructions after normalising what carries
no meaning (metadata, instruction and computation numbering, the order of computations), so that two
checkouts compile the same program exactly when their fingerprints agree. The tree imported is the
one on PYTHONPATH (configs/ is read from the current directory):

    cd OLD_CHECKOUT && PYTHONPATH=$PWD python NEW_CHECKOUT/experiments/hlo_fingerprint.py
    PYTHONPATH=$PWD python experiments/hlo_fingerprint.py --config.model.attention=xla

The benchmark harness is loaded from beside this file, so that OLD_CHECKOUT may predate it (overrides
are checked with the tree's own config schema, which needs a tree that has noloco_jax.config.cli's
`unknown_field`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re


def _harness():
  """experiments/lib/harness.py of this script's checkout (not of the tree on PYTHONPATH: see above)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "harness.py")
  spec = importlib.util.spec_from_file_location("hlo_fingerprint_harness", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


harness = _harness()


def normalise(hlo_text: str) -> list[str]:
  """The instruction lines, sorted, with metadata and numbering stripped."""
  text = re.sub(r", metadata=\{[^}]*\}", "", hlo_text)
  text = re.sub(r"region(_\d+)?\.\d+|region_\d+", "region", text)
  text = re.sub(r"\b(main)\.\d+", r"\1", text)
  text = re.sub(r"\b([A-Za-z_][\w\-]*)\.\d+(\.\d+)*\b", r"\1.N", text)
  skip = re.compile(r"^(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames|HloModule)")
  return sorted(line for line in text.splitlines() if line.strip() and not skip.match(line))


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=8)
  bench.parse(argv)
  import jax
  import numpy as np
  from noloco_jax.parallel import sharding as sharding_lib
  from noloco_jax.training import build as build_lib

  cfg = bench.config()
  cfg.outer.kind = "none"
  bench.override(cfg)
  setup = build_lib.build(cfg, vocab_size=257, check_data=False)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(setup.init_state), setup.state_shardings)
  n = cfg.num_replicas
  batch = sharding_lib.global_array(setup.mesh, np.zeros((n, cfg.data.batch_size, cfg.data.seq_len + 1), np.int32), n)
  lines = normalise(setup.inner_step.lower(state, batch).compile().as_text())
  result = {"benchmark": "hlo_fingerprint", "tree": os.path.dirname(os.path.dirname(os.path.dirname(build_lib.__file__))),
            "overrides": bench.overrides(), "instructions": len(lines),
            "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
  return bench.finish(result)


if __name__ == "__main__":
  harness.run(main)
