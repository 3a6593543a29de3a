"""Models behind `config.model.arch`, all through one interface (base.Model).

    model = models.get(config.model.arch).resolve(config.model, vocab_size=..., seq_len=...)

Llama (llama.py) is the first. A new architecture is one module with a `base.Model` subclass, added
to `_REGISTRY` here (or registered at run time with `register`, as tests/test_model_interface.py does).
"""

from noloco_jax.config import model as model_schema
from noloco_jax.models import base
from noloco_jax.models import llama

_REGISTRY: dict[str, type[base.Model]] = {llama.LlamaModel.arch: llama.LlamaModel}


def register(cls: type[base.Model]) -> type[base.Model]:
  """Makes `cls` selectable as config.model.arch = cls.arch (usable as a class decorator)."""
  _REGISTRY[cls.arch] = cls
  model_schema.register_arch(cls.arch)  # so that config validation accepts it
  return cls


def archs() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def get(arch: str) -> type[base.Model]:
  """The model class registered as `arch`; a ValueError naming the valid ones otherwise."""
  if arch not in _REGISTRY:
    raise ValueError(f"config.model.arch={arch!r} is not a registered model; valid: {', '.join(archs())}.")
  return _REGISTRY[arch]
