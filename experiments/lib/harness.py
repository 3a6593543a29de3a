"""The edges every script under experiments/ shares, so that each one reads top to bottom with its own
measurement in the middle: its command line, fake CPU devices, config overrides and the final JSON line.

    from experiments.lib import harness

    def main(argv=None) -> dict:
      bench = harness.Bench(__doc__, config=True, cpu_devices=lambda args: args.replicas)
      bench.add_argument("--replicas", type=int, default=8)
      args = bench.parse(argv)            # usage errors end here, in one line; devices are set
      import jax                          # only now: JAX reads its device count when it starts
      cfg = bench.override(bench.config())
      ... the measurement ...
      return bench.finish(result, text=lambda r: f"{r['step_s']:.3f} s/step")

    if __name__ == "__main__":
      harness.run(main)

What the harness owns, the same in every script:

- `--json`: the last line of stdout is one JSON object (the result), and nothing is printed after it;
  the script's text form and its progress lines (`note`), if it has them, then go to stderr. Without
  `--json` they go to stdout; a script with no text form prints the JSON line either way.
- Config overrides (`config=True`): `--config=FILE[:ARG]` (default configs/default.py) and repeated
  `--config.FIELD=VALUE`, the syntax of `python -m noloco_jax.main`. Each override is checked against
  the project's schema (noloco_jax/config/) when the command line is parsed, before anything is
  built: a misspelt field or a value of the wrong type is the trainer's one-line error and exit
  status 2. A script may declare more override groups (bench_ab.py's `--a.FIELD=VALUE`).
- Fake CPU devices (`cpu_devices`): JAX_NUM_CPU_DEVICES, set before JAX is imported (a value already in
  the environment wins, as in the tests' conftest). `cpu_only=True` also sets JAX_PLATFORMS=cpu.
- The machine every result was measured on: `finish` adds `"machine"` (CPU count, load average at the
  start and at the end, JAX version, backend) and `"benchmark"` (the script's name) to the result.
- Quick mode (`quick={flag: value}`): `--quick` makes those values the defaults (flags given on the
  command line still win), the seconds-long setting the tests run.
- `out=True`: `--out=PATH` also writes the result, indented, to a file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
from typing import Any, Callable, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = "configs/default.py"
_OVERRIDE = re.compile(r"^--(?P<group>\w+)\.(?P<path>[\w.]+)(?P<eq>=(?P<value>.*))?$", re.DOTALL)


def usage_error(message: str):
  """The project's usage error: `noloco_jax: MESSAGE` on stderr, exit status 2."""
  from noloco_jax.config import cli  # pylint: disable=g-import-not-at-top
  cli.exit_usage(message)


def run(main: Callable[[], Any]) -> None:
  """Runs `main()` as a script: an invalid config found while building (a ConfigError: the schema's
  checks across fields) is the same one-line usage error as a misspelt override."""
  from noloco_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    main()
  except ConfigError as e:
    usage_error(str(e))


def use_cpu_devices(count: int) -> None:
  """`count` fake CPU devices for the JAX that this process starts later (a value already set wins)."""
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(count))


def machine(load_at_start: Sequence[float] | None = None) -> dict:
  """What a result was measured on. The backend is read only where this process has started JAX: a
  driver of multi-process jobs (bench_network, bench_outer) reports null rather than start one."""
  backend = None
  if "jax" in sys.modules:
    try:
      from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
      if xla_bridge.backends_are_initialized():
        backend = sys.modules["jax"].default_backend()
    except (ImportError, AttributeError):  # another JAX version: leave it out rather than start one
      pass
  try:
    jax_version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    jax_version = None
  load = lambda avg: [round(x, 2) for x in avg] if avg else None  # 1, 5 and 15 minutes
  return {"cpu_count": os.cpu_count(), "load_avg_start": load(load_at_start), "load_avg": load(os.getloadavg()),
          "jax_version": jax_version, "backend": backend}


def parse_value(path: str, value: str, kind: type) -> Any:
  """The command line's string for config field `path` as a `kind`, or the schema's ConfigError."""
  from noloco_jax.config import fields  # pylint: disable=g-import-not-at-top
  if kind is bool:
    words = {"true": True, "1": True, "false": False, "0": False}
    if value.strip().lower() not in words:
      fields.fail(path, value, fields.TYPE_WORDS[bool])
    return words[value.strip().lower()]
  if kind in (int, float):
    try:
      return kind(value)
    except ValueError:
      fields.fail(path, value, fields.TYPE_WORDS[kind])
  return kind(value)


def parse_override(config, item: str) -> tuple[Any, str, Any]:
  """(section, field name, typed value) of "PATH=VALUE" in the ConfigDict `config`, or the schema's
  one-line ConfigError: PATH names no field (with the nearest one suggested), or a whole section, or
  VALUE is not of the field's type."""
  from noloco_jax.config import ConfigError, cli  # pylint: disable=g-import-not-at-top
  path, _, value = item.partition("=")
  unknown = cli.unknown_field(config, path)
  if unknown:
    raise ConfigError(unknown)
  *parents, leaf = path.split(".")
  node = config
  for name in parents:
    node = node[name]
  if hasattr(node[leaf], "keys"):
    raise ConfigError(f"config.{path} is a section, not a field; its fields are {', '.join(sorted(node[leaf].keys()))}.")
  # A renamed field's old name is a placeholder: no value, but a type (get_type still answers).
  return node, leaf, parse_value(path, value, node.get_type(leaf))


def apply_overrides(config, items: Iterable[str]):
  """Sets each "PATH=VALUE" on the ConfigDict `config`, converted to the field's type; returns it."""
  for item in items:
    node, leaf, value = parse_override(config, item)
    node[leaf] = value
  return config


def load_config(spec: str):
  """The ConfigDict of `--config=FILE[:ARG]`: FILE's `get_config(ARG)`, FILE relative to the current
  directory or else to the repository."""
  from noloco_jax.config import files as config_files  # pylint: disable=g-import-not-at-top
  path, _, arg = spec.partition(":")
  if not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
    path = os.path.join(REPO, path)
  if not os.path.exists(path):
    usage_error(f"--config={spec}: cannot load it: no file {path}.")
  module = config_files.load_sibling(path, os.path.splitext(os.path.basename(path))[0])
  return module.get_config(arg) if arg else module.get_config()


class Bench:
  """One script's command line and its final JSON line (see the module docstring)."""

  def __init__(self, doc: str | None, *, config: bool = False, groups: Sequence[str] = (),
               cpu_devices: int | Callable[[argparse.Namespace], int] | None = None, cpu_only: bool = False,
               quick: dict | None = None, quick_help: str = "", out: bool = False, name: str = ""):
    self.name = name or os.path.splitext(os.path.basename(_caller_file()))[0]
    self.parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    self.add_argument = self.parser.add_argument
    self.groups = (("config",) if config else ()) + tuple(groups)
    self._cpu_devices, self._cpu_only, self._quick = cpu_devices, cpu_only, quick
    self._load_at_start = os.getloadavg()
    self.args: argparse.Namespace | None = None
    self._overrides: dict[str, list[str]] = {g: [] for g in self.groups}
    self.add_argument("--json", action="store_true",
                      help="print one JSON object as the last line of stdout (the text form goes to stderr)")
    if config:
      self.add_argument("--config", dest="config_file", default=DEFAULT_CONFIG, metavar="FILE[:ARG]",
                        help=f"config file and its argument string, as for noloco_jax.main (default {DEFAULT_CONFIG})")
    if self.groups:
      flags = ", ".join(f"--{g}.FIELD=VALUE" for g in self.groups)
      self.parser.epilog = (f"Config overrides ({flags}, repeatable) take the fields of noloco_jax/config/, "
                            "e.g. --config.model.num_layers=4.")
    if out:
      self.add_argument("--out", default="", metavar="PATH", help="also write the JSON result to this file (indented)")
    if quick:
      settings = ", ".join(f"{k}={v}" for k, v in quick.items())
      self.add_argument("--quick", action="store_true",
                        help=f"seconds-long, for the tests: {quick_help or settings} (flags given win)")

  def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags; overrides checked against the schema (a bad one: one line, exit 2); devices set."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, self._overrides = [], {g: [] for g in self.groups}
    for arg in argv:
      match = _OVERRIDE.match(arg)
      if not match or match["group"] not in self.groups:
        rest.append(arg)
      elif not match["eq"]:
        usage_error(f"{arg} needs a value: {arg}=VALUE.")
      else:
        self._overrides[match["group"]].append(f"{match['path']}={match['value']}")
    args = self.parser.parse_args(rest)
    if self._quick and args.quick:
      self.parser.set_defaults(**self._quick)
      args = self.parser.parse_args(rest)
    self.args = args
    if self.groups:
      from noloco_jax import config as schema  # pylint: disable=g-import-not-at-top
      fields = schema.default_config_dict()  # every config file's fields (configs/default.py builds on it)
      try:
        for items in self._overrides.values():
          for item in items:
            parse_override(fields, item)
      except schema.ConfigError as e:
        usage_error(str(e))
    if self._cpu_devices is not None:
      use_cpu_devices(self._cpu_devices(args) if callable(self._cpu_devices) else self._cpu_devices)
    if self._cpu_only:
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return args

  def overrides(self, group: str = "config") -> list[str]:
    """The "FIELD=VALUE" overrides given as --GROUP.FIELD=VALUE, in order."""
    return list(self._overrides[group])

  def config(self):
    """A fresh ConfigDict from --config=FILE[:ARG], without the overrides (`override` applies them, so
    that a script's own settings come first and the command line's win)."""
    return load_config(self.args.config_file)

  def override(self, config, *groups: str):
    """`config` with the overrides of `groups` (default: --config.*) applied in order; returns it."""
    for group in groups or ("config",):
      apply_overrides(config, self._overrides[group])
    return config

  def note(self, line: str) -> None:
    """A progress line, printed now where the text form goes (stdout; stderr under --json)."""
    print(line, file=sys.stderr if self.args is not None and self.args.json else sys.stdout, flush=True)

  def finish(self, result: dict, text: Callable[[dict], str] | None = None) -> dict:
    """Prints the result (the module docstring says where) with "benchmark" and "machine" added;
    returns it. Nothing may be printed after it."""
    result = {"benchmark": self.name, **result, "machine": machine(self._load_at_start)}
    json_mode = self.args is not None and self.args.json
    if text is not None:
      print(text(result), file=sys.stderr if json_mode else sys.stdout, flush=True)
    if json_mode or text is None:
      print(json.dumps(result), flush=True)
    if getattr(self.args, "out", ""):
      with open(self.args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


def _caller_file() -> str:
  """The file of the script that made the Bench (its name is the result's "benchmark")."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  return frame.f_globals.get("__file__") or sys.argv[0]
