"""Plots of experiment sweeps (experiments/lib/experiment.py): curves against inner steps, final metrics against a swept value.

Imported only by the notebooks and the experiment scripts: matplotlib is not a dependency of the core
(the `plots` extra installs it).
"""

from __future__ import annotations

from typing import Mapping, Sequence

try:
  import matplotlib
  import matplotlib.pyplot as plt
except ImportError as e:  # The core install has no matplotlib (setup.py: extra "plots").
  raise ImportError("experiments.lib.plots needs matplotlib: pip install -e '.[plots]'") from e

from experiments.lib import experiment
from experiments.lib.experiment import Run


def plot_sweep(results: Mapping[str, Sequence[Run]], title: str = "",
               keys: Sequence[str] = ("eval/loss", "replicas/weight_std"), path: str | None = None):
  """One panel per metric against inner steps, mean over seeds with a ±std band; log scale for weight std."""
  if path is not None:
    matplotlib.use("Agg", force=False)  # a file, not a window: no display needed
  fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
  for ax, key in zip(axes[0], keys):
    for label, runs in results.items():
      steps, mean, std = experiment.curve(runs, key)
      if not len(steps):
        continue
      line, = ax.plot(steps, mean, marker=".", label=label)
      ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("inner step")
    ax.set_ylabel(key)
    if "weight_std" in key:
      ax.set_yscale("symlog", linthresh=1e-4)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=120)
  return fig


def plot_final(series: Mapping[str, Mapping[float, Sequence[Run]]], key: str, xlabel: str, ax=None,
               logx: bool = False):
  """Final `key` (mean ± std over seeds) against a swept value, one line per series; diverged runs skipped."""
  if ax is None:
    _, ax = plt.subplots(figsize=(5.2, 3.8))
  for name, by_x in series.items():
    xs = sorted(by_x)
    stats = [experiment.final([r for r in by_x[x] if not r.diverged] or by_x[x], key) for x in xs]
    ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3, label=name)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(f"final {key}")
  if logx:
    ax.set_xscale("log")
  if "weight_std" in key:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return ax
