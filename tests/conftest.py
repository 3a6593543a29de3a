"""Test set-up: 8 fake CPU devices, created before JAX starts, so mesh code runs for real."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after the environment above, which must precede any JAX import)


@pytest.fixture
def compile_cache(tmp_path):
  """A persistent compilation cache for one test's runs (a resumed run reuses the first run's
  programs); JAX's settings are restored afterwards."""
  import jax  # pylint: disable=g-import-not-at-top  (only once the environment above is set)
  options = {"jax_compilation_cache_dir": str(tmp_path / "jax_cache"),
             "jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": -1}
  saved = {k: getattr(jax.config, k) for k in options}
  for k, v in options.items():
    jax.config.update(k, v)
  yield options
  for k, v in saved.items():
    jax.config.update(k, v)
