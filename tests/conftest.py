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


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
  """A finished smoke run (NoLoCo, 8 replicas, 12 steps, checkpoints at steps 6 and 12) for the tools used
  after a run (export_hf, sample, report). A non-default RoPE base and two layers, so that an exporter that dropped the base or
  mixed up the layers would be caught. Built once per test process; tests must not write into it."""
  from configs import default  # pylint: disable=g-import-not-at-top  (after the environment above)
  from noloco_jax import training  # pylint: disable=g-import-not-at-top
  cfg = default.get_config("smoke")
  cfg.checkpoint_every = 6
  cfg.model.rope_theta = 500.0
  cfg.model.num_layers = 2  # more than one layer: the stacked layer axis is cut into model.layers.<i>
  workdir = str(tmp_path_factory.mktemp("finished_run"))
  training.train_and_evaluate(cfg, workdir)
  return workdir
