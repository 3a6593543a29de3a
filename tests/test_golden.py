"""Golden run: the smoke config's metrics.jsonl, every metric but timings, reproduced bitwise on CPU.

Any change that moves a number (a refactor must not) fails here. When a change is *meant* to move the
numbers (new attention kernel, new pairing law, ...), regenerate the file in the same commit and state
the difference in the commit message:

    NOLOCO_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import os

from configs import default
from noloco_jax import training

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "smoke_metrics.jsonl")
TIMINGS = ("perf/",)  # wall-clock figures differ from run to run by nature


def _rows(path: str) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def test_smoke_run_reproduces_the_golden_metrics_bitwise(tmp_path):
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
