"""Loading one config file from another. main loads config files by path (ml_collections), so a
config that builds on configs/default.py imports its sibling by path too. Standard library only:
config files are read while flags are parsed, before JAX is set up."""

import importlib.util
import os
import types


def load_sibling(config_file: str, name: str) -> types.ModuleType:
  """The module `name`.py in the directory of `config_file` (pass `__file__`)."""
  path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"noloco_{name}_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
