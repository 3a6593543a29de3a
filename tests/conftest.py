"""Test set-up: 8 fake CPU devices, created before JAX starts, so mesh code runs for real."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after the environment above, which must precede any JAX import)

# The tiers. Default: every test but those marked `exhaustive` or `real` (`bash scripts/test.sh`, what CI
# runs first; within CI's time on a 2-core machine). `@pytest.mark.exhaustive(reason=...)`: left out of
# the default run because a cheaper test of it proves the same, which the reason names (the benchmarks'
# quick modes, three of the four notebooks, bfloat16 cases whose float32 case stays, end-to-end variants
# whose sibling stays); `bash scripts/test.sh --all` (NOLOCO_TESTS=all) runs them. `@pytest.mark.real`:
# starts a real component (scripts/test_real.sh: NOLOCO_TESTS=real runs only these). The marker sits on
# the test (or its `pytest.param`), so a rename carries it; a misspelt marker is an error, not a test
# silently run in the default tier (tests/test_tiers.py).
EXHAUSTIVE_HELP = ("exhaustive(reason): left out of the default run, because a cheaper test of the default run "
                   "proves the same (the reason says which); `bash scripts/test.sh --all` runs it")
REAL_HELP = ("real: runs a real component (SLURM, etcd, shaped links in network namespaces) that the test "
             "starts and stops itself, as root; the tier of its own that `bash scripts/test_real.sh` runs (CI runs it)")


def pytest_configure(config):
  config.addinivalue_line("markers", EXHAUSTIVE_HELP)
  config.addinivalue_line("markers", REAL_HELP)
  # An unregistered marker (a misspelt `exhaustive` or `real`) fails the collection instead of warning.
  config.addinivalue_line("filterwarnings", "error::pytest.PytestUnknownMarkWarning")


def exhaustive_reason(item) -> str | None:
  """Why `item` is in the exhaustive tier (None: it is not); a mark without a reason is a usage error."""
  mark = item.get_closest_marker("exhaustive")
  if mark is None:
    return None
  reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
  if not isinstance(reason, str) or not reason.strip():
    raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.exhaustive needs reason=\"...\" (the cheaper test "
                            "of the default run that proves the same).")
  return reason


def _tier() -> str:
  return os.environ.get("NOLOCO_TESTS", "").lower()


def pytest_collection_modifyitems(config, items):
  exhaustive = {item.nodeid for item in items if exhaustive_reason(item) is not None}  # every mark checked
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
    left_out = item.nodeid in exhaustive and os.path.abspath(str(item.path)) not in named
    (left if left_out else kept).append(item)
  if left:
    config.hook.pytest_deselected(items=left)
    items[:] = kept


def pytest_report_header(config):
  if _tier() == "real":
    return "noloco_jax: the real-component tier only (tests marked `real`: SLURM, etcd, shaped links)"
  if _tier() == "all":
    return "noloco_jax: every test, the exhaustive tier included (NOLOCO_TESTS=all)"
  return ("noloco_jax: the default run; the exhaustive tier (tests marked `exhaustive`) is deselected: "
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
