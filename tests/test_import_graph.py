"""The package's import graph (scripts/import_graph.py): no cycles, no imports hidden in functions."""

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
