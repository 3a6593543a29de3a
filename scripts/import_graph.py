"""The package's shape as JSON: module sizes, the longest function, the step loop's size, the import
graph, its cycles and its upward imports.

    python scripts/import_graph.py            # this checkout
    python scripts/import_graph.py --root DIR # another checkout (DIR holds noloco_jax/)

Reads the source with `ast` only (nothing is imported, so it also runs on an old checkout). An edge
A -> B means module A imports module B of the package, at module level or inside a function: both
count for cycles, since an import moved into a function to dodge a cycle still is one. Importing
`pkg.sub.mod` also runs `pkg/__init__` and `pkg/sub/__init__` first, so it is an edge to each of
them too, except to the importer's own parent packages (already initialised, or being initialised,
when it runs). Cycles are the strongly connected components of more than one module (or a module
importing itself). `folders` is the same graph with modules merged into their folders, for reading
the layering (`folder_cycles`: its cycles; a folder-level cycle is not an import cycle).
`upward_imports` are the edges that go against the layers of docs/architecture.md (`LAYERS`: a module
may import only its own layer or lower ones). `step_loop` is the function holding the training loop
(`for step in range(...)`): its lines, the loop's lines and `if`s, and how many of the package's
modules its module imports.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Any

PACKAGE = "noloco_jax"
# The layers, bottom first (docs/architecture.md): a module's layer is that of its longest listed prefix.
LAYERS = (("noloco_jax.config",), ("noloco_jax.models", "noloco_jax.inner", "noloco_jax.io.data"),
          ("noloco_jax.parallel", "noloco_jax.runtime"), ("noloco_jax.outer", "noloco_jax.asynchronous", "noloco_jax.io"),
          ("noloco_jax.training",), ("noloco_jax.tools",), ("noloco_jax.main", "noloco_jax"))


# Modules allowed to import package modules inside a function, and why. Their edges count like any other
# (cycles included); they are listed under `deferred_imports`, not `function_level_imports`.
DEFERRED = {"noloco_jax.main": "the entry point checks its command line before it imports JAX (0.2 s, not 2.6 s, "
            "to answer a mistyped field)",
            "noloco_jax.outer.methods": "the methods' specs are read before JAX is imported (the config is checked "
            "against them); each imports the JAX parts of its rule when it is built (and so do the modules of the "
            "package)"}


def deferred_key(module: str) -> str | None:
  """The DEFERRED entry that allows `module` to import inside functions: itself, or a package above it."""
  return next((d for d in DEFERRED if module == d or module.startswith(d + ".")), None)


def layer(module: str) -> int:
  best, level = -1, len(LAYERS)
  for i, prefixes in enumerate(LAYERS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and len(p) > best:
        best, level = len(p), i
  return level


def _step_loop(tree: ast.Module, module: str):
  """(function name, its lines, the loop's lines, the loop's ifs) of a function holding `for step ...`."""
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for node in ast.walk(fn):
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "step"
            and isinstance(node.iter, ast.Call) and getattr(node.iter.func, "id", None) == "range"):
          ifs = sum(isinstance(n, ast.If) for n in ast.walk(node))
          return (f"{module}:{fn.name}", fn.end_lineno - fn.lineno + 1, node.end_lineno - node.lineno + 1, ifs)
  return None


def _modules(root: str) -> dict[str, str]:
  """{dotted module name: file path} of every .py file under root/noloco_jax."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
    for name in sorted(filenames):
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        out[".".join(rel)] = os.path.join(dirpath, name)
  return out


def _resolve(name: str, modules: dict[str, str]) -> str | None:
  """The longest prefix of `name` that is a module of the package (None for other packages)."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    candidate = ".".join(parts[:i])
    if candidate in modules:
      return candidate
  return None


def _imports(tree: ast.Module, module: str, is_package: bool, modules: dict[str, str]):
  """Yields (target module, line, inside a function?) for each import of a package module."""
  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        for alias in child.names:
          if (target := _resolve(alias.name, modules)):
            yield target, child.lineno, in_function
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:  # relative import
          anchor = module.split(".") if is_package else module.split(".")[:-1]
          anchor = anchor[:len(anchor) - child.level + 1]
          base = ".".join(anchor + ([base] if base else []))
        for alias in child.names:
          target = _resolve(f"{base}.{alias.name}", modules) if base else None
          if target and target != base or (target := _resolve(base, modules)):
            yield target, child.lineno, in_function
      yield from visit(child, inner)
  yield from visit(tree, False)


def _functions(tree: ast.Module, module: str):
  """Yields (qualified name, lines) of every function and method."""
  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield f"{prefix}{child.name}", child.end_lineno - child.lineno + 1
        yield from visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        yield from visit(child, f"{prefix}{child.name}.")
  yield from visit(tree, f"{module}:")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with a cycle (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

  def strongconnect(v):
    work = [(v, iter(sorted(graph[v])))]
    index[v] = low[v] = counter[0]; counter[0] += 1
    stack.append(v); on_stack.add(v)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter[0]; counter[0] += 1
          stack.append(child); on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          w = stack.pop(); on_stack.discard(w); component.append(w)
          if w == node:
            break
        if len(component) > 1 or node in graph[node]:
          out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      strongconnect(v)
  return sorted(out)


def analyse(root: str) -> dict[str, Any]:
  modules = _modules(root)
  graph: dict[str, set[str]] = {m: set() for m in modules}
  sizes, function_imports, deferred, functions, loops = {}, [], [], [], []
  for module, path in modules.items():
    with open(path) as f:
      source = f.read()
    sizes[module] = len(source.splitlines())
    tree = ast.parse(source)
    own_parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    for target, line, in_function in _imports(tree, module, path.endswith("__init__.py"), modules):
      parts = target.split(".")
      for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in modules and name != module and (name == target or name not in own_parents):
          graph[module].add(name)
      if in_function:
        (deferred if deferred_key(module) else function_imports).append(f"{module}:{line} imports {target}")
    functions.extend(_functions(tree, module))
    loop = _step_loop(tree, module)
    if loop is not None:
      loops.append(loop)
  longest = max(functions, key=lambda f: f[1])
  folders = _folders(graph, modules)
  upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer(t) > layer(m))
  step_loop = [{"function": name, "lines": lines, "loop_lines": loop_lines, "loop_ifs": ifs,
                "module_imports": len(graph[name.split(":")[0]])} for name, lines, loop_lines, ifs in loops]
  return {
      "root": os.path.abspath(root),
      "num_modules": len(modules),
      "total_lines": sum(sizes.values()),
      "module_lines": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
      "modules_over_400_lines": sorted(m for m, n in sizes.items() if n > 400),
      "longest_function": {"name": longest[0], "lines": longest[1]},
      "functions_over_100_lines": sorted(f"{n} ({k})" for n, k in functions if k > 100),
      "step_loop": step_loop,
      "imports": {m: sorted(t) for m, t in sorted(graph.items())},
      "function_level_imports": function_imports,
      "deferred_imports": deferred,
      "cycles": _cycles(graph),
      "folders": folders,
      "folder_cycles": _cycles({k: set(v) for k, v in folders.items()}),
      "upward_imports": upward,
  }


def _folders(graph: dict[str, set[str]], modules: dict[str, str]) -> dict[str, list[str]]:
  """{folder: folders it imports}: a module's folder is its package (a package's own __init__ included);
  the modules at the package's top level (main, config) are nodes of their own."""
  def folder(m):
    if modules[m].endswith("__init__.py") or m.count(".") == 1:
      return m
    return m.rpartition(".")[0]
  out: dict[str, set[str]] = {}
  for m, targets in graph.items():
    out.setdefault(folder(m), set()).update(folder(t) for t in targets if folder(t) != folder(m))
  return {k: sorted(v) for k, v in sorted(out.items())}


def default_root() -> str:
  """The directory holding this checkout's noloco_jax package."""
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=default_root(),
                      help="directory holding the noloco_jax package (default: this checkout)")
  parser.add_argument("--summary", action="store_true", help="leave out the per-module graph")
  args = parser.parse_args(argv)
  result = analyse(args.root)
  if args.summary:
    result.pop("imports")
    result.pop("module_lines")
  json.dump(result, sys.stdout, indent=1)
  print()


if __name__ == "__main__":
  main()
