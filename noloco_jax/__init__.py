"""noloco_jax: NoLoCo, DiLoCo and data-parallel training of Llama models in JAX/Flax."""

__version__ = "0.1.0"
