"""Fingerprint of the default job's compiled inner step: is it the same program as another checkout's?

Prints one JSON line with a hash of the optimized HLO's instructions after normalising what carries
no meaning (metadata, instruction and computation numbering, the order of computations), so that two
checkouts compile the same program exactly when their fingerprints agree. The tree imported is the
one on PYTHONPATH (configs/ is read from the current directory):

    cd OLD_CHECKOUT && PYTHONPATH=$PWD python NEW_CHECKOUT/experiments/hlo_fingerprint.py
    PYTHONPATH=$PWD python experiments/hlo_fingerprint.py --set model.attention=xla
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re


def normalise(hlo_text: str) -> list[str]:
  """The instruction lines, sorted, with metadata and numbering stripped."""
  text = re.sub(r", metadata=\{[^}]*\}", "", hlo_text)
  text = re.sub(r"region(_\d+)?\.\d+|region_\d+", "region", text)
  text = re.sub(r"\b(main)\.\d+", r"\1", text)
  text = re.sub(r"\b([A-Za-z_][\w\-]*)\.\d+(\.\d+)*\b", r"\1.N", text)
  skip = re.compile(r"^(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames|HloModule)")
  return sorted(line for line in text.splitlines() if line.strip() and not skip.match(line))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  import jax
  import numpy as np
  from configs import default
  from noloco_jax.parallel import sharding as sharding_lib
  from experiments.lib import experiment
  from noloco_jax.training import build as build_lib

  cfg = default.get_config()
  cfg.outer.kind = "none"
  experiment.apply_overrides(cfg, args.set)
  setup = build_lib.build(cfg, vocab_size=257, check_data=False)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(setup.init_state), setup.state_shardings)
  n = cfg.num_replicas
  batch = sharding_lib.global_array(setup.mesh, np.zeros((n, cfg.data.batch_size, cfg.data.seq_len + 1), np.int32), n)
  lines = normalise(setup.inner_step.lower(state, batch).compile().as_text())
  result = {"benchmark": "hlo_fingerprint", "tree": os.path.dirname(os.path.dirname(os.path.dirname(build_lib.__file__))),
            "overrides": args.set, "instructions": len(lines),
            "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
