"""Test set-up: 8 fake CPU devices, created before JAX starts, so mesh code runs for real."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after the environment above, which must precede any JAX import)

# The exhaustive tier: tests the default run (`bash scripts/test.sh`, what CI runs) leaves out and
# `bash scripts/test.sh --all` (NOLOCO_TESTS=all) runs, so that the default run stays within CI's time
# on a 2-core machine. A test is here only when what it proves is also proved in the default run by a
# cheaper test: the benchmarks' quick modes (each script's parts have unit tests), three of the four
# notebooks (notebook 02 and compare_methods stay in), the bfloat16 case of a kernel-equivalence test
# whose float32 case stays in, and end-to-end variants whose sibling case stays in. Keys are test ids or
# their prefixes (every parametrization of a test).
EXHAUSTIVE = {
    **{f"tests/test_notebooks.py::test_notebook_runs_in_smoke_mode[{name}]": "a notebook end to end (notebook "
       "02 stays in: the same experiment library, sweeps, tables and figures)"
       for name in ("01_group_size_and_H.ipynb", "03_pairing_dtype_momentum.ipynb", "04_compression.ipynb")},
    "tests/test_notebooks.py::test_compare_methods_smoke_json": "compare_methods end to end: "
    "tests/test_compare_methods.py runs it too",
    "tests/test_bench_network.py::test_quick_on_loopback": "bench_network's quick mode without root (its parts: "
    "the file's unit tests; on per-node links: the real tier's quick run)",
    **{f"tests/test_elastic.py::test_killed_job_resumed_by_the_survivor_trains_to_the_end[{mode}": f"{mode} "
       "after a killed job, through the command line (grow stays, and drop and recreate from inside an "
       "overlap window)" for mode in ("drop", "recreate")},
    "tests/test_checkpoint.py::test_restore_onto_fewer_devices_continues_the_same_run": "training on after "
    "a restore onto fewer devices (the restore: test_restore_onto_two_devices_is_bitwise; several replicas "
    "per device: tests/test_train.py's simulator test)",
    "tests/test_compression.py::test_coded_mesh_and_simulator_paths_agree_bitwise[topk": "top-k's mesh path "
    "against the simulator (int4's stays, and top-k's round against NumPy)",
    "tests/test_overlap.py::test_bench_overlap_quick_mode_reports_both_settings": "bench_overlap's quick mode "
    "(overlap's behaviour: the rest of test_overlap.py)",
    "tests/test_bench_mfu.py::test_bench_prints_the_fields_on_a_tiny_model": "bench_mfu end to end (its "
    "FLOP count: the other tests of the file)",
    "tests/test_attention.py::test_xla_equals_einsum_values_and_gradients[bfloat16": "bfloat16 case (float32 "
    "stays in)",
    "tests/test_attention.py::test_model_logits_do_not_depend_on_the_kernel[bfloat16": "bfloat16 case "
    "(float32 stays in)",
    "tests/test_losses.py::test_model_loss_and_all_parameter_gradients_match_with_chunks[bfloat16": "bfloat16 "
    "case (float32 stays in)",
}


def _exhaustive_reason(nodeid: str) -> str | None:
  return next((why for key, why in EXHAUSTIVE.items() if nodeid.startswith(key)), None)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "real: runs a real component (SLURM, etcd, shaped links in network namespaces) that the test "
      "starts and stops itself, as root; the tier of its own that `bash scripts/test_real.sh` runs (CI runs it)")


def _tier() -> str:
  return os.environ.get("NOLOCO_TESTS", "").lower()


def pytest_collection_modifyitems(config, items):
  # The real-component tier runs on its own (scripts/test_real.sh: NOLOCO_TESTS=real), or with every test.
  if _tier() == "real":
    left = [item for item in items if item.get_closest_marker("real") is None]
    items[:] = [item for item in items if item.get_closest_marker("real") is not None]
    if left:
      config.hook.pytest_deselected(items=left)
    return
  if _tier() == "all":
    return
  real = [item for item in items if item.get_closest_marker("real") is not None]
  if real:
    config.hook.pytest_deselected(items=real)
    items[:] = [item for item in items if item.get_closest_marker("real") is None]
  # A file named on the command line runs whole (`pytest tests/test_notebooks.py` runs every notebook).
  named = {os.path.abspath(arg.split("::")[0]) for arg in config.args if arg.split("::")[0].endswith(".py")}
  kept, left = [], []
  for item in items:
    left_out = _exhaustive_reason(item.nodeid) and os.path.abspath(str(item.path)) not in named
    (left if left_out else kept).append(item)
  if left:
    config.hook.pytest_deselected(items=left)
    items[:] = kept


def pytest_report_header(config):
  if _tier() == "real":
    return "noloco_jax: the real-component tier only (tests marked `real`: SLURM, etcd, shaped links)"
  if _tier() == "all":
    return "noloco_jax: every test, the exhaustive tier included (NOLOCO_TESTS=all)"
  return ("noloco_jax: the default run; the exhaustive tier (tests/conftest.py EXHAUSTIVE) is deselected: "
          "`bash scripts/test.sh --all` runs it; the real-component tier: `bash scripts/test_real.sh`")


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
