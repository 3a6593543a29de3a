"""Golden run: the smoke config's metrics.jsonl, every metric but timings, reproduced bitwise on CPU.

Any change that moves a number (a refactor must not) fails here. When a change is *meant* to move the
numbers (new attention kernel, new pairing law, ...), regenerate the file in the same commit and state
the difference in the commit message:

    NOLOCO_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py

(in each environment that has a golden file: `.venv` and scripts/env_next.sh's `.venv-next`).
"""

import json
import os
import sys

import jax
import pytest

from configs import default
from noloco_jax import training

# The numbers depend on the Python version (the corpus is its standard library's sources) and on
# jax's minor version (its XLA). One golden file per tested pair: CI's main environment (Python 3.11,
# jax 0.10) and the newest one (scripts/env_next.sh: Python 3.13, jax 0.12).
_PYTHON = f"py{sys.version_info[0]}.{sys.version_info[1]}"
_JAX = "jax" + ".".join(jax.__version__.split(".")[:2])
_NAME = "smoke_metrics.jsonl" if (_PYTHON, _JAX) == ("py3.11", "jax0.10") else f"smoke_metrics.{_PYTHON}-{_JAX}.jsonl"
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", _NAME)
TIMINGS = ("perf/",)  # wall-clock figures differ from run to run by nature


def _rows(path: str) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def test_smoke_run_reproduces_the_golden_metrics_bitwise(tmp_path):
  if not os.path.isfile(GOLDEN) and not os.environ.get("NOLOCO_REGENERATE_GOLDEN"):
    pytest.skip(f"no golden metrics for {_PYTHON} with {_JAX} (tests/golden/{_NAME}); tested pairs: Python 3.11 with "
                "jax 0.10, Python 3.13 with jax 0.12. NOLOCO_REGENERATE_GOLDEN=1 writes one.")
  training.train_and_evaluate(default.get_config("smoke"), str(tmp_path))
  got = _rows(os.path.join(tmp_path, "metrics.jsonl"))
  if os.environ.get("NOLOCO_REGENERATE_GOLDEN"):
    with open(GOLDEN, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in got)
  want = _rows(GOLDEN)
  assert len(got) == len(want), (len(got), len(want))
  for g, w in zip(got, want):
    # Exact equality of the float64 values written to JSON: not a tolerance.
    assert g == w, f"step {w.get('step')}: got {g}, golden {w}"
