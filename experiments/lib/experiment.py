"""Small experiments on top of `training.train_and_evaluate`: configs, seed sweeps, summaries and plots.

Shared by experiments/compare_methods.py and the ablation notebooks in experiments/ablations/, so that
they differ only in what they sweep. Their plots are in experiments/lib/plots.py (matplotlib is imported only there). JAX must already have its devices: set JAX_NUM_CPU_DEVICES
before the first `import jax` (a notebook's first cell, a script's first lines).

The setting ("mini"): the embedded standard-library corpus with the byte tokenizer, a 2-layer Llama
of width 64 (~140k parameters per replica), 8 replicas × 4 sequences × 64 tokens per inner step,
300 inner steps. One to three minutes per run on two shared CPU cores. `smoke=True` swaps in the
`configs/default.py:smoke` sizes (seconds per run) so that tests can execute every notebook.

Per-method outer hyperparameters are the paper's (docs/method.md §10): NoLoCo α=0.5, β=γ=0.7, n=2;
DiLoCo α=0.3, β=0.7, heavy-ball. H is scaled to the short runs (see `MINI_INNER_STEPS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping, Sequence

import ml_collections
import numpy as np

from noloco_jax import config as config_lib
from noloco_jax.config.outer import OuterConfig
from noloco_jax.outer import methods
from noloco_jax.config import files as config_files
from noloco_jax.runtime import compile_cache
from noloco_jax.io import metrics as metrics_lib
from noloco_jax import training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The cumulative bytes per replica a run logs (noloco_jax/outer/wire.py): on the wire, sent and
#: received, and the compiled collectives' operands.
COMM_KEYS = ("comm/bytes_sent_per_replica", "comm/bytes_received_per_replica",
             "comm/collective_operand_bytes_per_replica")
SMOKE_ENV = "NOLOCO_SMOKE"  # "1" shrinks notebooks and scripts to seconds (tests/test_notebooks.py)
CACHE_ENV = compile_cache.ENV  # directory of JAX's persistent compilation cache; "" disables

#: H for the 300-step mini runs: the paper's 50 (NoLoCo) and 100 (DiLoCo) halved, keeping their 1:2
#: ratio, so that a run has 12 NoLoCo and 6 DiLoCo rounds (the paper: 500 and 250 over 25,000 steps).
MINI_INNER_STEPS = {"noloco": 25, "gossip": 25, "epidemic": 25, "epidemic_adam": 25, "diloco": 50}

_MINI = dict(num_steps=300, eval_every=25, log_every=25, warmup_steps=30, seq_len=64, batch_size=4,
             eval_batches=16, d_model=64, num_layers=2, num_heads=4, mlp_dim=192)


def smoke_from_env() -> bool:
  """True when NOLOCO_SMOKE is set to anything but '', '0' or 'false'."""
  return os.environ.get(SMOKE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def enable_compile_cache(path: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache (runs of one sweep share most of their programs).

  The same mechanism as main.py's: noloco_jax/runtime/compile_cache.py (where, and how to turn it off).
  """
  return compile_cache.enable(path)


def load_default_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """configs/default.py's `get_config(arg)`, loaded by path (configs/ is not a package)."""
  return config_files.load_sibling(os.path.join(REPO, "configs", "default.py"), "default").get_config(arg)


def base_config(*, smoke: bool = False, num_replicas: int = 8, num_steps: int | None = None,
                seed: int = 0) -> ml_collections.ConfigDict:
  """The shared setting of every comparison: `mini` (see the module docstring), or `smoke`."""
  config = load_default_config("smoke" if smoke else None)
  if not smoke:
    m = _MINI
    config.num_steps, config.eval_every, config.log_every = m["num_steps"], m["eval_every"], m["log_every"]
    config.inner.warmup_steps = m["warmup_steps"]
    config.data.seq_len, config.data.batch_size, config.data.eval_batches = m["seq_len"], m["batch_size"], m["eval_batches"]
    config.model.d_model, config.model.num_layers = m["d_model"], m["num_layers"]
    config.model.num_heads, config.model.mlp_dim = m["num_heads"], m["mlp_dim"]
  config.num_replicas = num_replicas
  config.seed = seed
  if num_steps is not None:
    config.num_steps = num_steps
  return config


def method_config(base: ml_collections.ConfigDict, kind: str, *, smoke: bool = False,
                  **outer: Any) -> ml_collections.ConfigDict:
  """`base` with `outer.kind=kind`, the paper's hyperparameters for it, then `outer` overrides.

  H is MINI_INNER_STEPS[kind], or with `smoke` the smoke config's own H, unless given in `outer`.
  """
  config = ml_collections.ConfigDict(base.to_dict())
  config.outer.update(methods.defaults(kind))  # the kind and its (the paper's) values: its spec's
  config.outer.inner_steps = base.outer.inner_steps if smoke else MINI_INNER_STEPS.get(kind, base.outer.inner_steps)
  for name, value in outer.items():  # a flat name (group_size=4) goes to its section (outer.rule.group_size)
    *path, last = OuterConfig.RENAMED.get(name, name).split(".")
    node = config.outer
    for part in path:
      node = node[part]
    if isinstance(value, dict):  # a section given whole: rule=dict(group_size=4)
      node[last].update(value)
    else:
      node[last] = value
  return config


def tokens_per_step(config: ml_collections.ConfigDict) -> int:
  """Training tokens consumed per inner step by all replicas together."""
  return config.num_replicas * config.data.batch_size * config.data.seq_len


# ---------------------------------------------------------------------------------------------------
# Running.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One finished (or diverged) training run, without its state."""
  label: str
  seed: int
  config: ml_collections.ConfigDict  # as the run trained with it: validated, every field resolved
  eval: list[dict]  # {"step", "eval/loss", "eval/ppl", "replicas/weight_std"} at every evaluation
  train: list[dict]  # the train rows of metrics.jsonl (train/loss, comm/bytes_sent_per_replica, perf/...)
  final: dict  # train_and_evaluate's summary (eval/loss, eval/ppl, COMM_KEYS, ...)
  error: str | None = None  # set when the run stopped on a non-finite loss

  @property
  def diverged(self) -> bool:
    return self.error is not None


def run(config: ml_collections.ConfigDict, *, label: str = "", workdir: str | None = None,
        quiet: bool = True) -> Run:
  """Trains `config` in `workdir` (emptied first; a temporary directory when None) and reads back its metrics.

  A run that hits a non-finite loss returns with `error` set and NaN final metrics instead of raising,
  so that a sweep over unstable settings (the γ ablation) completes.
  """
  temporary = workdir is None
  workdir = tempfile.mkdtemp(prefix="noloco_run_") if temporary else workdir
  if os.path.exists(workdir):
    shutil.rmtree(workdir)  # metrics.jsonl is appended to: a rerun must not mix with old rows
  error, result = None, {}
  out = io.StringIO()
  absl_logger = logging.getLogger("absl")
  old_level = absl_logger.level
  try:
    if quiet:
      absl_logger.setLevel(logging.WARNING)
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
      result = training.train_and_evaluate(config, workdir)
  except training.NonFiniteLossError as e:
    error = str(e)
  finally:
    absl_logger.setLevel(old_level)
  path = os.path.join(workdir, "metrics.jsonl")
  rows = metrics_lib.read_jsonl(path) if os.path.exists(path) else []
  evals = [r for r in rows if "eval/loss" in r]
  trains = [r for r in rows if "train/loss" in r]
  if error is None:
    final = {k: v for k, v in result.items() if k not in ("state", "history", "text")}
  else:
    final = {"eval/loss": math.nan, "eval/ppl": math.nan, "replicas/weight_std": math.nan,
             **{k: trains[-1][k] if trains else math.nan for k in COMM_KEYS}}
  if temporary:
    shutil.rmtree(workdir, ignore_errors=True)
  return Run(label=label or config.outer.kind, seed=int(config.seed), config=config_lib.validate(config),
             eval=evals, train=trains, final=final, error=error)


def load_run(workdir: str, label: str = "") -> Run:
  """A finished run read back from its workdir (config.json, metrics.jsonl, summary.json)."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return Run(label=label or config.outer.kind, seed=int(config.seed), config=config,
             eval=[r for r in rows if "eval/loss" in r], train=[r for r in rows if "train/loss" in r],
             final=summary)


def _finished_with(workdir: str, config: ml_collections.ConfigDict) -> bool:
  """Whether `workdir` holds a finished run of exactly `config`."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      stored = json.load(f)
  except (OSError, ValueError):
    return False
  # config.json holds the validated config (every field resolved: an unset per-kind field has its value).
  resolved = config_lib.validate(config)
  return os.path.exists(os.path.join(workdir, "summary.json")) and stored == json.loads(resolved.to_json_best_effort())


def run_seeds(config: ml_collections.ConfigDict, seeds: Iterable[int], *, label: str = "",
              workdir_root: str | None = None, verbose: bool = True, reuse: bool = False) -> list[Run]:
  """`config` once per seed (the seed drives initial weights, data order, evaluation sample, pairings).

  With `reuse`, a seed whose workdir already holds a finished run of the same config is read back
  instead of trained again (to re-plot or re-summarise a sweep).
  """
  runs = []
  for seed in seeds:
    c = ml_collections.ConfigDict(config.to_dict())
    c.seed = int(seed)
    name = label or c.outer.kind
    workdir = None if workdir_root is None else os.path.join(workdir_root, f"{_slug(name)}_seed{seed}")
    reused = reuse and workdir is not None and _finished_with(workdir, c)
    r = load_run(workdir, label=name) if reused else run(c, label=name, workdir=workdir)
    if verbose:
      status = f"diverged: {r.error}" if r.diverged else (
          f"eval/loss {r.final['eval/loss']:.4f}  weight_std {r.final['replicas/weight_std']:.2e}")
      print(f"{name:>24s}  seed {seed}: {status}{'  (reused)' if reused else ''}", flush=True)
    runs.append(r)
  return runs


def sweep(configs: Mapping[str, ml_collections.ConfigDict], seeds: Iterable[int], *,
          workdir_root: str | None = None) -> dict[str, list[Run]]:
  """{label: runs over `seeds`} for every labelled config."""
  seeds = list(seeds)
  return {label: run_seeds(c, seeds, label=label, workdir_root=workdir_root) for label, c in configs.items()}


def _slug(text: str) -> str:
  return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


# ---------------------------------------------------------------------------------------------------
# Summaries.
# ---------------------------------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value). NaN if any value is NaN."""
  x = np.asarray(values, np.float64)
  return float(np.mean(x)), float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def final(runs: Sequence[Run], key: str) -> tuple[float, float]:
  """Mean ± std over seeds of a final metric."""
  return mean_std([r.final[key] for r in runs])


def curve(runs: Sequence[Run], key: str, source: str = "eval") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(steps, mean over seeds, std over seeds) of `key` at the steps every run logged it."""
  per_run = [{row["step"]: float(row[key]) for row in getattr(r, source) if key in row} for r in runs]
  steps = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
  values = np.array([[d[s] for s in steps] for d in per_run], np.float64).reshape(len(per_run), len(steps))
  std = values.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(len(steps))
  return np.asarray(steps), values.mean(axis=0), std


_FORMATS = {"replicas/weight_std": ".2e", **{key: ",.0f" for key in COMM_KEYS}}


def table(results: Mapping[str, Sequence[Run]],
          keys: Sequence[str] = ("eval/loss", "eval/ppl", "replicas/weight_std")) -> str:
  """A Markdown table: one row per label, mean ± std over seeds of each final metric."""
  lines = ["| setting | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
  for label, runs in results.items():
    cells = []
    for key in keys:
      mean, std = final(runs, key)
      fmt = _FORMATS.get(key, ".3f")
      cells.append(f"{mean:{fmt}}" if key.startswith("comm/") else f"{mean:{fmt}} ± {std:{fmt}}")
    diverged = sum(r.diverged for r in runs)
    note = f" ({diverged} diverged)" if diverged else ""
    lines.append(f"| {label} | {len(runs)}{note} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
