r"""What a new user pays: install time, virtualenv size, import time, time to the first training step.

    python experiments/bench_install.py --json                 # a fresh venv in a temporary dir
    python experiments/bench_install.py --json --python=python3.12 --keep=/tmp/venv312

Steps, all timed from this script with wall clocks:
  1. `python -m venv` into an empty directory, then `pip install --no-cache-dir -e REPO`: every
     package is downloaded and unpacked (no pip cache, no wheel reuse); install_s is the pip step.
  2. venv_bytes: the size of the virtualenv on disk (`du -sb`), pip itself included.
  3. import_s: `import noloco_jax.main` in a fresh interpreter of that venv (median of --imports runs,
     after one untimed run that writes the .pyc files); import_loop_s: the same for
     `noloco_jax.training.loop` (the trainer: writers, data, checkpoints); whether TensorFlow is
     installed at all.
  4. first_step_s: the default job (configs/default.py) cut to one step, from the command's start to
     its exit, with an empty data dir, so it includes building the corpus and its token cache,
     compiling, the step-0 evaluation, the step, the final evaluation and the checkpoint: an upper
     bound on the time to the first training step. first_step_warm_s: the same again with the data
     dir now built (the compile cache is off in both).
Optionally (--baseline_python) the size of its venv and steps 3-4 for another interpreter and
checkout, for before/after in the same run.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

from experiments.lib import harness

REPO = harness.REPO

_IMPORT_CODE = "import time; t = time.perf_counter(); import {}; print(time.perf_counter() - t)"


def _run(cmd, cwd=REPO, env=None) -> float:
  t = time.perf_counter()
  subprocess.run(cmd, cwd=cwd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  return time.perf_counter() - t


def _import_s(python: str, repo: str, module: str, imports: int) -> float:
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  subprocess.run([python, "-c", f"import {module}"], cwd=repo, env=env, check=True)
  runs = [float(subprocess.run([python, "-c", _IMPORT_CODE.format(module)], cwd=repo, env=env, check=True,
                               capture_output=True, text=True).stdout.strip().splitlines()[-1])
          for _ in range(imports)]
  return statistics.median(runs)


def _first_step_s(python: str, repo: str, scratch: str) -> tuple[float, float]:
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  times = []
  for run in ("cold", "warm"):
    cmd = [python, "-m", "noloco_jax.main", "--config=configs/default.py", f"--workdir={scratch}/run_{run}",
           "--config.num_steps=1", f"--config.data.data_dir={scratch}/data"]
    times.append(_run(cmd, cwd=repo, env=env))
  return times[0], times[1]


def _measure(python: str, repo: str, scratch: str, imports: int) -> dict:
  cold, warm = _first_step_s(python, repo, scratch)
  return {"import_s": round(_import_s(python, repo, "noloco_jax.main", imports), 3),
          "import_loop_s": round(_import_s(python, repo, "noloco_jax.training.loop", imports), 3),
          "first_step_s": round(cold, 1),
          "first_step_warm_s": round(warm, 1)}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--python", default=sys.executable, help="interpreter that creates the venv")
  bench.add_argument("--keep", default="", help="create the venv here and keep it (default: a temporary dir)")
  bench.add_argument("--imports", type=int, default=5, help="timed import runs")
  bench.add_argument("--baseline_python", default="", help="a venv's python to compare with (e.g. the old one)")
  bench.add_argument("--baseline_repo", default="", help="the checkout that --baseline_python runs")
  args = bench.parse(argv)
  with tempfile.TemporaryDirectory() as tmp:
    venv = args.keep or os.path.join(tmp, "venv")
    t = time.perf_counter()
    subprocess.run([args.python, "-m", "venv", venv], check=True)
    venv_s = time.perf_counter() - t
    pip = os.path.join(venv, "bin", "pip")
    install_s = _run([pip, "install", "--no-cache-dir", "--quiet", "-e", REPO])
    size = int(subprocess.run(["du", "-sb", venv], check=True, capture_output=True, text=True).stdout.split()[0])
    python = os.path.join(venv, "bin", "python")
    has_tf = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('tensorflow') is not None)"],
                            check=True, capture_output=True, text=True).stdout.strip() == "True"
    version = subprocess.run([python, "-c", "import sys, jax; print(sys.version.split()[0], jax.__version__)"],
                             check=True, capture_output=True, text=True).stdout.split()
    result = {"python": version[0], "jax": version[1], "venv_create_s": round(venv_s, 1),
              "install_s": round(install_s, 1), "venv_bytes": size, "venv_gb": round(size / 1e9, 3),
              "tensorflow_installed": has_tf, **_measure(python, REPO, os.path.join(tmp, "new"), args.imports)}
    if args.baseline_python:
      base = _measure(args.baseline_python, args.baseline_repo or REPO, os.path.join(tmp, "base"), args.imports)
      base_venv = os.path.dirname(os.path.dirname(args.baseline_python))
      base["venv_bytes"] = int(subprocess.run(["du", "-sb", base_venv], check=True, capture_output=True,
                                              text=True).stdout.split()[0])
      result.update({f"baseline_{k}": v for k, v in base.items()})
  return bench.finish(result, text=lambda r: "\n".join(f"{k:28s} {v}" for k, v in r.items()))


if __name__ == "__main__":
  harness.run(main)
