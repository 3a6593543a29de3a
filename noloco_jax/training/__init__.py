"""Training: build a run (build.py), open it (run.py), train it (loop.py) with a round driver (rounds/)
and plug-ins (plugins/), carrying its loop state (loop_state.py) to the summary (summary.py).

    from noloco_jax import training
    training.train_and_evaluate(config, workdir)

The function `build` is not re-exported: `noloco_jax.training.build` stays the module
(`from noloco_jax.training import build as build_lib; build_lib.build(config)`).
"""

from noloco_jax.io.checkpoint import NonFiniteLossError
from noloco_jax.training.build import Setup
from noloco_jax.training.loop import train_and_evaluate
from noloco_jax.training.loop_state import LoopState
from noloco_jax.training.plugins import evaluate
