"""Usage errors of the command line as one line on stderr and exit status 2 (no traceback).

`parse_flags` is main.py's absl flag parser. absl and ml_collections report a misspelt override
(`--config.outer.momentun=0.9`) as an AttributeError holding an escaped KeyError, and a value of the
wrong type as a flag error with usage hints; both become e.g.

    noloco_jax: config.outer.momentun is not a field; did you mean config.outer.rule.outer_momentum?
    noloco_jax: config.num_steps='abc' is not valid: an integer.

A config file that cannot be loaded (a syntax error, an exception in `get_config`) is one line naming
the file and line, e.g. `noloco_jax: flag --config=my.py: SyntaxError: invalid syntax (my.py, line 1)`.
A ConfigError raised later (config.validate, the data checks) goes through `exit_usage` in main.py.
"""

import dataclasses
import os
import re
import sys
import traceback
from typing import NoReturn, Sequence

from absl import flags
import ml_collections
from ml_collections import config_flags

from noloco_jax.config.fields import TYPE_WORDS, Section, not_a_field
from noloco_jax.config.run import Config

USAGE_ERROR = 2  # exit status of a usage error (as argparse and most Unix tools)
_OVERRIDE = re.compile(r"^--?(?P<flag>\w+)\.(?P<path>[\w.]+)(=(?P<value>.*))?$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_BAD_VALUE = re.compile(r"flag --(?P<flag>\w+)\.(?P<path>[\w.]+)=(?P<value>.*?): ")


def exit_usage(message: str) -> NoReturn:
  print(f"noloco_jax: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS, config_flag: str = "config"):
  """absl's flag parsing (for app.run's flags_parser): a usage error prints one line and exits 2."""
  try:
    rest = flag_values(argv)
  except (flags.Error, AttributeError, KeyError) as e:
    exit_usage(explain(argv, e, flag_values, config_flag))
  except Exception as e:  # pylint: disable=broad-except
    # A config file with a syntax error, or one that raised something absl does not wrap (ZeroDivisionError,
    # ImportError, ...): one line naming the file and line, as for every other config error.
    message = config_file_error(argv, e, config_flag)
    if message is None:
      raise
    exit_usage(message)
  try:
    # A config file that cannot be loaded leaves a stand-in that raises when it is first read.
    getattr(flag_values[config_flag].value, "keys", None)
  except OSError as e:
    last = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
    exit_usage(f"--{config_flag}={flag_values[config_flag].config_filename}: cannot load it: {last}")
  return rest


def config_file_error(argv: Sequence[str], error: Exception, config_flag: str) -> str | None:
  """One line for an exception raised while the --config file was loaded, or None if it came from elsewhere."""
  arg = _config_arg(argv, config_flag)
  if arg is None:
    return None
  path = os.path.abspath(arg.split(":", 1)[0])
  if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == path:
    line = error.lineno
  else:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == path]
    if not frames:
      return None
    line = frames[-1].lineno
  text = (error.msg if isinstance(error, SyntaxError) else str(error)).strip().split("\n", 1)[0]
  return f"flag --{config_flag}={arg}: {type(error).__name__}: {text} ({arg.split(':', 1)[0]}, line {line})"


def explain(argv: Sequence[str], error: Exception, flag_values: flags.FlagValues, config_flag: str) -> str:
  """One line saying which field or flag is wrong and what would be valid."""
  config = _load_config(argv, flag_values, config_flag)
  arg = _config_arg(argv, config_flag)
  if arg is not None and config is None and f"--{config_flag} must have a value other than None" in str(error):
    # absl's words name the value, None, not the file that gave it ("flag --config=None: ...").
    return (f"flag --{config_flag}={arg}: get_config() returned None; it must return the config "
            "(an ml_collections.ConfigDict): is its return statement missing?")
  if config is not None:
    for arg in argv[1:]:
      match = _OVERRIDE.match(arg)
      if match and match["flag"] == config_flag:
        unknown = unknown_field(config, match["path"])
        if unknown:
          return unknown
    match = _BAD_VALUE.search(str(error))
    if match and match["flag"] == config_flag:
      current = _value_at(config, match["path"])
      valid = TYPE_WORDS.get(type(current), f"a value of type {type(current).__name__}")
      return f"config.{match['path']}={match['value']!r} is not valid: {valid}."
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  if not lines:
    return type(error).__name__
  if len(lines) == 1:
    return lines[0]
  # A config file that raised while loading: its flag, the exception's own last line, and where in
  # the config file (the innermost frame of the traceback absl put into the message) it was raised.
  frames = _FRAME.findall(str(error))
  where = f" ({frames[-1][0]}, line {frames[-1][1]})" if frames else ""
  return f"{lines[0].split(': ')[0]}: {lines[-1]}{where}"


def _config_arg(argv, config_flag) -> str | None:
  """The value given to --config (FILE[:ARGS]), or None."""
  return next((a.split("=", 1)[1] for a in argv[1:] if a.startswith((f"--{config_flag}=", f"-{config_flag}="))), None)


def _load_config(argv, flag_values, config_flag) -> ml_collections.ConfigDict | None:
  """The config file's ConfigDict without the overrides, or None when it cannot be loaded."""
  arg = _config_arg(argv, config_flag)
  if arg is None:
    return None
  try:
    return flag_values[config_flag].parser.parse(arg)
  except Exception:  # pylint: disable=broad-except  (the original error is reported instead)
    return None


def unknown_field(config: ml_collections.ConfigDict, path: str) -> str | None:
  """The error for an override path that names no field of `config`, or None if it names one."""
  node, section, walked = config, Config, []
  for name in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return f"config.{'.'.join(walked)} is a field, not a section: config.{path} does not exist."
    if name not in node:
      renamed = section.RENAMED if section else {}
      return str(not_a_field(".".join(walked), name, [k for k in node.keys() if k not in renamed], renamed))
    section = _sections(section).get(name)
    node, walked = node[name], walked + [name]
  return None


def _sections(section) -> dict:
  """{field name: Section class} of a section's sub-sections (none for a leaf section or None)."""
  if section is None:
    return {}
  return {f.name: f.type for f in dataclasses.fields(section) if isinstance(f.type, type) and issubclass(f.type, Section)}


def _value_at(config: ml_collections.ConfigDict, path: str):
  node = config
  for name in path.split("."):
    node = node[name]
  return node


# ---------------------------------------------------------------------------------------------------
# Cluster scripts (scripts/slurm_gpu.sbatch): how many replicas a job of D devices runs; a field's value.
# ---------------------------------------------------------------------------------------------------


def replicas_for_devices(num_replicas: int, num_stages: int, fsdp: int, devices: int) -> int | None:
  """The num_replicas to run on `devices` devices (one per process, e.g. one GPU per SLURM task).

  None when the config's own layout (num_replicas × num_stages × fsdp) uses exactly those devices:
  the config decides, e.g. a paper-grid row. Otherwise one replica per group of num_stages × fsdp
  devices, the config's devices per replica kept (the default job: one replica per GPU). ValueError
  when that group does not divide the devices.
  """
  per_replica = num_stages * fsdp
  if num_replicas * per_replica == devices:
    return None
  if devices % per_replica:
    raise ValueError(f"the config gives each replica num_stages × fsdp = {num_stages} × {fsdp} = {per_replica} "
                     f"devices, which does not divide this job's {devices} devices: set NUM_REPLICAS, or ask "
                     f"for a multiple of {per_replica} GPUs.")
  return devices // per_replica


def _config_from_flags(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """The config that --config=FILE[:ARGS] and its --config.FIELD=VALUE overrides in argv build (other flags
  are ignored); a usage error is one line on stderr and exit 2."""
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=flag_values)
  parse_flags([argv[0], *(a for a in argv[1:] if a.startswith(("--config=", "--config.")))], flag_values)
  return flag_values.config


def _layout_main(argv: Sequence[str]) -> int:
  """`python -m noloco_jax.config.cli DEVICES --config=FILE[:ARGS] [--config.FIELD=VALUE ...] [other flags]`:
  prints the num_replicas to pass for a job of DEVICES devices, or nothing to keep the config's (other
  flags, e.g. --heartbeat_timeout_s, are ignored). A config error is one line on stderr and exit 2."""
  devices = int(argv[1])
  config = _config_from_flags([argv[0], *argv[2:]])
  try:
    replicas = replicas_for_devices(config.num_replicas, config.num_stages, config.fsdp, devices)
  except ValueError as e:
    exit_usage(str(e))
  if replicas is not None:
    print(replicas)
  return 0


def _field_main(argv: Sequence[str]) -> int:
  """`python -m noloco_jax.config.cli field NAME --config=FILE[:ARGS] [--config.FIELD=VALUE ...] [other flags]`:
  prints the value of config field NAME (e.g. outer.schedule) as the flags set it. Unknown field: one line, exit 2."""
  if len(argv) < 3 or argv[2].startswith("-"):
    exit_usage("usage: python -m noloco_jax.config.cli field NAME --config=FILE[:ARGS] [--config.FIELD=VALUE ...]")
  path, config = argv[2], _config_from_flags([argv[0], *argv[3:]])
  problem = unknown_field(config, path)
  if problem is not None:
    exit_usage(problem)
  print(_value_at(config, path))
  return 0


if __name__ == "__main__":
  sys.exit(_field_main(sys.argv) if sys.argv[1:2] == ["field"] else _layout_main(sys.argv))
