"""The stability region of NoLoCo's outer update over (α, γ), beside the paper's interval.

    python experiments/plot_stability.py            # writes docs/stability.png, prints the markdown table

Computed by noloco_jax/outer/stability.py (noise-driven model, λ = 0); see docs/stability.md.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from noloco_jax.outer import stability

ALPHAS = np.linspace(0.0, 0.99, 100)
GAMMAS = np.linspace(0.01, 2.0, 200)


def growth_grid(group_size: int, num_replicas: int) -> np.ndarray:
  """[len(GAMMAS), len(ALPHAS)]: √ρ, the long-run factor per round of the weight std across replicas."""
  return np.array([[stability.spread_growth_per_round(a, g, group_size, num_replicas) for a in ALPHAS]
                   for g in GAMMAS])


def plot(path: str, num_replicas: int) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
  for ax, n in zip(axes, (2, 4)):
    grid = growth_grid(n, num_replicas)
    image = ax.pcolormesh(ALPHAS, GAMMAS, np.minimum(grid, 1.5), shading="auto", cmap="RdYlGn_r", vmin=0.4, vmax=1.5)
    ax.contour(ALPHAS, GAMMAS, grid, levels=[1.0], colors="k", linewidths=2)
    low, high = zip(*(stability.paper_interval(a, n) for a in ALPHAS))
    ax.plot(ALPHAS, low, "b--", label="paper's interval")
    ax.plot(ALPHAS, high, "b--")
    ax.plot([0.5], [0.7], "k*", markersize=12, label="defaults (α=0.5, γ=0.7)")
    if n == 2:
      ax.plot([0.9, 0.9], [1.2, 0.3], "wo", markeredgecolor="k", label="issue's examples (α=0.9; γ=1.2, 0.3)")
    ax.set_title(f"n = {n}, N = {num_replicas}; black: exact boundary √ρ = 1")
    ax.set_xlabel("α (outer momentum)")
    ax.set_ylim(GAMMAS[0], GAMMAS[-1])
    ax.legend(loc="upper left", fontsize=8)
  axes[0].set_ylabel("γ (pull to the group mean)")
  fig.colorbar(image, ax=axes, label="weight-std growth per round √ρ (clipped at 1.5)")
  fig.savefig(path, dpi=110, bbox_inches="tight")


def table(num_replicas: int) -> str:
  alphas = (0.0, 0.3, 0.5, 0.7, 0.9)
  gammas = (0.1, 0.3, 0.5, 0.7, 0.9, 1.2, 1.5, 1.8)
  lines = []
  for n in (2, 4):
    lines.append(f"\n√ρ for n = {n}, N = {num_replicas} (bold: unstable, √ρ ≥ 1; * = inside the paper's interval)\n")
    lines.append("| γ \\ α | " + " | ".join(f"{a:g}" for a in alphas) + " |")
    lines.append("|---|" + "---|" * len(alphas))
    for g in gammas:
      cells = []
      for a in alphas:
        r = stability.spread_growth_per_round(a, g, n, num_replicas)
        low, high = stability.paper_interval(a, n)
        text = f"{r:.3f}" + ("*" if low < g < high else "")
        cells.append(f"**{text}**" if r >= 1 else text)
      lines.append(f"| {g:g} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--num_replicas", type=int, default=8)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "stability.png"))
  args = parser.parse_args()
  plot(args.out, args.num_replicas)
  print(table(args.num_replicas))


if __name__ == "__main__":
  main()
