"""Set-up shared by the ablation notebooks: `from common import *` as a notebook's first code line.

Creates the fake CPU devices before JAX starts, turns on JAX's
persistent compilation cache, and reads the smoke switch:

    NOLOCO_SMOKE=1   tiny sizes (configs/default.py:smoke), one seed, short sweeps: seconds per run
                     (what tests/test_notebooks.py executes)
    NOLOCO_SEEDS=0,1,2   seeds of a full run (default 0,1)

Everything else comes from experiments.lib.experiment and its plots, experiments.lib.plots,
re-exported here as `experiment` and `plots`.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before the first `import jax`
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.lib import experiment  # noqa: E402
from experiments.lib import plots  # noqa: E402
from noloco_jax import config as config_lib  # noqa: E402
from noloco_jax.outer import stability  # noqa: E402

experiment.enable_compile_cache()
SMOKE = experiment.smoke_from_env()
SEEDS = [0] if SMOKE else [int(s) for s in os.environ.get("NOLOCO_SEEDS", "0,1").split(",")]
BASE = experiment.base_config(smoke=SMOKE)  # 8 replicas; mini (300 steps) or smoke (12 steps)
PLOTS = os.path.join(REPO, "experiments", "plots")


def noloco(**outer):
  """NoLoCo with the paper's hyperparameters on BASE, with `outer` overrides (e.g. group_size=4)."""
  return experiment.method_config(BASE, "noloco", smoke=SMOKE, **outer)


def method(kind, **outer):
  """Any outer kind (noloco, diloco, gossip, ddp, none) with its paper hyperparameters on BASE."""
  return experiment.method_config(BASE, kind, smoke=SMOKE, **outer)


def save(fig, name):
  """Saves a figure to experiments/plots/ablation_NAME.png, only in a full (non-smoke) run."""
  if not SMOKE:
    os.makedirs(PLOTS, exist_ok=True)
    fig.savefig(os.path.join(PLOTS, f"ablation_{name}.png"), dpi=120)


__all__ = ["BASE", "PLOTS", "REPO", "SEEDS", "SMOKE", "config_lib", "experiment", "method", "noloco", "plots", "save", "stability"]
