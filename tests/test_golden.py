"""Golden run: the smoke config's metrics.jsonl, every metric but timings, reproduced bitwise on CPU.

Any change that moves a number (a refactor must not) fails here. When a change is *meant* to move the
numbers (new attention kernel, new pairing law, ...), regenerate the file in the same commit and state
the difference in the commit message:

    NOLOCO_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py

(in each environment that has a golden file: `.venv` and scripts/env_next.sh's `.venv-next`).

The last bits depend on the CPU as well as on the software: XLA:CPU compiles for the host's vector
units, so a reduction's order (a norm, a mean over replicas) differs between, say, an AVX-512 Xeon and
an AVX2 EPYC (measured: the same commit gave `outer/pseudo_grad_norm` 0.46036875 on one and 0.46036878
on the other at the first round; no XLA flag reproduced one on the other). Each file is therefore
recorded for one CPU class (`cpu_class()`: vendor and widest vector extension):

- a file recorded for this CPU class exists: bitwise against it;
- else: bitwise against any file of the same Python and jax (another machine that happens to agree);
- else: every value within float32 round-off (relative 1e-5) of one of them, and the test says so.
  Regenerating writes this class's file and deletes the others that no longer agree within round-off.
"""

import glob
import json
import math
import os
import subprocess
import sys
import warnings

import jax
import pytest


# The numbers depend on the Python version (the corpus is its standard library's sources) and on
# jax's minor version (its XLA). One set of files per tested pair: CI's main environment (Python 3.11,
# jax 0.10) and the newest one (scripts/env_next.sh: Python 3.13, jax 0.12).
_PYTHON = f"py{sys.version_info[0]}.{sys.version_info[1]}"
_JAX = "jax" + ".".join(jax.__version__.split(".")[:2])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
_PAIR = f"smoke_metrics.{_PYTHON}-{_JAX}"
TIMINGS = ("perf/",)  # wall-clock figures differ from run to run by nature
ROUND_OFF = 1e-5  # relative: a few float32 ulps carried through 12 steps of training


def cpu_class() -> str:
  """The CPU class a golden file is recorded for: vendor and widest vector extension, e.g. intel-avx512."""
  vendor, flags = "unknown", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
          vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(value.strip(), value.strip().lower())
        elif key.strip() in ("flags", "Features"):
          flags = set(value.split())
          break
  except OSError:
    pass
  isa = next((i for i in ("avx512f", "avx2", "avx", "asimd") if i in flags), "other")
  return f"{vendor}-{isa.replace('avx512f', 'avx512')}"


def _path(cpu: str) -> str:
  return os.path.join(GOLDEN_DIR, f"{_PAIR}.{cpu}.jsonl")


def _rows(path: str) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def _first_difference(got: list[dict], want: list[dict]) -> str | None:
  """None when equal bitwise (the float64 values written to JSON: not a tolerance), else the first row that differs."""
  if len(got) != len(want):
    return f"{len(got)} rows, golden {len(want)}"
  for g, w in zip(got, want):
    if g != w:
      return f"step {w.get('step')}: got {g}, golden {w}"
  return None


def _within_round_off(got: list[dict], want: list[dict]) -> bool:
  if len(got) != len(want) or any(g.keys() != w.keys() for g, w in zip(got, want)):
    return False
  return all(math.isclose(g[k], w[k], rel_tol=ROUND_OFF, abs_tol=1e-12) if isinstance(w[k], float) else g[k] == w[k]
             for g, w in zip(got, want) for k in w)


def _smoke_run_at_xla_s_default_level(workdir: str) -> None:
  """The smoke run in a process of its own, compiled as a user's run is: scripts/test.sh compiles the
  other tests with --xla_backend_optimization_level=0 (a faster compile; its code rounds some
  transcendental functions differently in the last bit), which this process leaves out."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags))
  code = "import sys; from configs import default; from noloco_jax import training; " \
         "training.train_and_evaluate(default.get_config('smoke'), sys.argv[1])"
  out = subprocess.run([sys.executable, "-c", code, workdir], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]


def test_cpu_class_names_a_vendor_and_an_extension():
  vendor, _, isa = cpu_class().partition("-")
  assert vendor and isa, cpu_class()


def test_smoke_run_reproduces_the_golden_metrics_bitwise(tmp_path):
  here = _path(cpu_class())
  recorded = sorted(glob.glob(os.path.join(GOLDEN_DIR, f"{_PAIR}.*.jsonl")))
  regenerate = bool(os.environ.get("NOLOCO_REGENERATE_GOLDEN"))
  if not recorded and not regenerate:
    pytest.skip(f"no golden metrics for {_PYTHON} with {_JAX} (tests/golden/{_PAIR}.*.jsonl); tested pairs: Python "
                "3.11 with jax 0.10, Python 3.13 with jax 0.12. NOLOCO_REGENERATE_GOLDEN=1 writes one.")
  _smoke_run_at_xla_s_default_level(str(tmp_path))
  got = _rows(os.path.join(tmp_path, "metrics.jsonl"))
  if regenerate:
    with open(here, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in got)
    for other in recorded:  # another CPU's record that this change moved beyond round-off is stale
      if other != here and not _within_round_off(got, _rows(other)):
        os.remove(other)
    return
  if here in recorded:
    difference = _first_difference(got, _rows(here))
    assert difference is None, f"{os.path.basename(here)} (recorded on this CPU class): {difference}"
    return
  if any(_first_difference(got, _rows(p)) is None for p in recorded):
    return
  close = [p for p in recorded if _within_round_off(got, _rows(p))]
  assert close, "; ".join(f"{os.path.basename(p)}: {_first_difference(got, _rows(p))}" for p in recorded)
  warnings.warn(f"no golden file for CPU class {cpu_class()}: checked to relative {ROUND_OFF} against "
                f"{os.path.basename(close[0])}, not bitwise (NOLOCO_REGENERATE_GOLDEN=1 records this class)")
