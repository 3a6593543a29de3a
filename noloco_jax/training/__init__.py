"""The driver: build a run (build.py), carry its loop state (loop_state.py), train it (loop.py).

    from noloco_jax import training
    training.train_and_evaluate(config, workdir)

The function `build` is not re-exported: `noloco_jax.training.build` stays the module
(`from noloco_jax.training import build as build_lib; build_lib.build(config)`).
"""

from noloco_jax.training.build import Setup
from noloco_jax.training.loop import NonFiniteLossError
from noloco_jax.training.loop import evaluate
from noloco_jax.training.loop import train_and_evaluate
from noloco_jax.training.loop_state import LoopState
