"""noloco_jax: NoLoCo, DiLoCo and data-parallel training of Llama models in JAX/Flax."""

# The outer methods register their specs with the config schema (config/outer.py) first: a config is read
# against them. Neither imports JAX (noloco_jax/outer/methods/__init__.py).
from noloco_jax.outer import methods as _methods  # noqa: F401

__version__ = "0.1.0"
