"""The package's import graph (scripts/import_graph.py): no cycles, no imports hidden in functions."""

import ast
import importlib.util
import os

# scripts/ holds developer tools, not a package: load the script by its path.
_SPEC = importlib.util.spec_from_file_location(
    "import_graph", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "import_graph.py"))
import_graph = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(import_graph)


def test_the_package_has_no_import_cycles_and_no_function_level_imports():
  result = import_graph.analyse(import_graph.default_root())
  assert result["num_modules"] > 30, result["num_modules"]  # the walk found the package
  assert result["cycles"] == [], result["cycles"]
  assert result["function_level_imports"] == [], result["function_level_imports"]
  # Only the entry point defers imports (import_graph.DEFERRED says why), and it does defer them.
  assert {import_graph.deferred_key(d.split(":")[0]) for d in result["deferred_imports"]} == set(import_graph.DEFERRED), (
      result["deferred_imports"])
  assert result["folder_cycles"] == [], result["folder_cycles"]  # the folders are layered too


def test_the_analysis_finds_a_cycle_and_a_function_level_import(tmp_path):
  # A two-module package whose cycle is hidden in a function: both must be reported.
  pkg = tmp_path / "noloco_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from noloco_jax import b\n\ndef f():\n  return b.g()\n")
  (pkg / "b.py").write_text("def g():\n  from noloco_jax import a  # dodges the cycle\n  return a\n")
  result = import_graph.analyse(str(tmp_path))
  assert result["cycles"] == [["noloco_jax.a", "noloco_jax.b"]]
  assert result["function_level_imports"] == ["noloco_jax.b:2 imports noloco_jax.a"]
  assert result["imports"]["noloco_jax.a"] == ["noloco_jax.b"]
  assert result["longest_function"]["lines"] == 3


# Who still takes the whole config: a parameter named `config` or `setup` (unless its annotation names a
# section type: LlamaConfig, CheckpointConfig, ...), or one annotated Config or Setup. Whole modules: the
# schema, the entry point and the tools that read a finished run's config. Set-up (training/build.py,
# run.py, and the factories it calls) holds the whole record and hands the components below their section
# or plain values (docs/architecture.md); the functions named after it are the rest, each with its reason.
# A component that stops taking the whole record leaves this list (the test asks for it); one that starts
# taking it fails the test.
WHOLE_CONFIG_MODULES = ("noloco_jax.config", "noloco_jax.main", "noloco_jax.tools", "noloco_jax.export_hf",
                        "noloco_jax.sample", "noloco_jax.report")
WHOLE_CONFIG_FUNCTIONS = {
    "noloco_jax.training.build:build": "set-up",
    "noloco_jax.training.loop:train_and_evaluate": "set-up",
    "noloco_jax.training.run:open_run": "set-up",
    "noloco_jax.training.run:checkpoint_info": "set-up: the checkpointer's part of the run (io/checkpoint/run_info.py)",
    "noloco_jax.training.rounds:make_driver": "set-up: the round driver, from the Setup",
    "noloco_jax.training.plugins.evaluation:evaluate": "public (training.evaluate): a Setup's evaluation of a state",
    "noloco_jax.training.summary:summarize": "the end-of-run summary reports the run's config",
    "noloco_jax.training.summary:exchange_in_force": "the end-of-run summary",
    "noloco_jax.training.summary:_outer_line": "the end-of-run summary",
    "noloco_jax.training.summary:_start_line": "the end-of-run summary",
    "noloco_jax.training.summary:_spread_line": "the end-of-run summary",
    "noloco_jax.asynchronous.job:check_layout": "an asynchronous process's start-up, called by main.py",
    "noloco_jax.asynchronous.job:process_config": "an asynchronous process's start-up: the config it runs",
    "noloco_jax.asynchronous.job:start": "an asynchronous process's start-up: its control plane",
    "noloco_jax.asynchronous.job:_check_same_config": "compares the whole record across the job's processes",
    "noloco_jax.asynchronous.result:job_config": "reads a finished job's config (the report)",
    "noloco_jax.runtime.job_checks:flatten_config": "the whole record as data: compared across processes",
    "noloco_jax.runtime.job_checks:describe_config_mismatch": "the whole record as data: compared across processes",
}


def _takes_whole_config(arg) -> bool:
  annotation = ast.unparse(arg.annotation).split(".")[-1] if arg.annotation else ""
  if annotation in ("Config", "Setup"):
    return True
  return arg.arg in ("config", "setup") and not annotation.endswith("Config")


def whole_config_takers(root: str) -> set[str]:
  """'module:function' of each function under root/noloco_jax (outside WHOLE_CONFIG_MODULES) taking the whole config."""
  takers = set()
  for module, path in import_graph._modules(root).items():  # pylint: disable=protected-access
    if module.startswith(WHOLE_CONFIG_MODULES):
      continue
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        if any(_takes_whole_config(a) for a in args):
          takers.add(f"{module}:{node.name}")
  return takers


def test_only_set_up_takes_the_whole_config():
  takers = whole_config_takers(import_graph.default_root())
  assert takers == set(WHOLE_CONFIG_FUNCTIONS), (
      f"new: {sorted(takers - set(WHOLE_CONFIG_FUNCTIONS))}; no longer: {sorted(set(WHOLE_CONFIG_FUNCTIONS) - takers)}")
