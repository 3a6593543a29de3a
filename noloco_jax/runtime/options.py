"""The multi-process options of noloco_jax.main: its flags, their NOLOCO_* variables, their defaults.

Kept apart from distributed.py (which starts `jax.distributed` and imports JAX) so that main.py can
define and check its command line before importing JAX: a mistyped flag or config field is answered
in a fraction of a second, not after the seconds JAX, Orbax and the data libraries take to import.
distributed.py uses them; its docstring says where the values come from.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from absl import flags

from noloco_jax.config import cli

ENV = {
    "mode": "NOLOCO_DISTRIBUTED",
    "coordinator_address": "NOLOCO_COORDINATOR_ADDRESS",
    "num_processes": "NOLOCO_NUM_PROCESSES",
    "process_id": "NOLOCO_PROCESS_ID",
    "heartbeat_timeout_s": "NOLOCO_HEARTBEAT_TIMEOUT_S",
    "initialization_timeout_s": "NOLOCO_INITIALIZATION_TIMEOUT_S",
    "shutdown_timeout_s": "NOLOCO_SHUTDOWN_TIMEOUT_S",
    "standalone_service": "NOLOCO_STANDALONE_SERVICE",
    "control": "NOLOCO_CONTROL",
}
MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class Options:
  mode: str = "auto"
  coordinator_address: str | None = None  # "host:port" of process 0's coordinator service
  num_processes: int | None = None
  process_id: int | None = None
  # A process that sends no heartbeat for this long is declared dead and the job is ended
  # (JAX's default is 100 s; shorter here so a lost process ends the job sooner).
  heartbeat_timeout_s: int = 60
  initialization_timeout_s: int = 300  # how long processes wait for each other at start-up
  shutdown_timeout_s: int = 120  # how long a finished process waits for the others at exit
  # The asynchronous schedule (docs/async.md): the coordination service runs in a process of its own
  # (python -m noloco_jax.asynchronous.control --port=PORT) at coordinator_address, not in process 0.
  standalone_service: int = 0
  # The asynchronous schedule's control plane (docs/async.md §5): "jax", JAX's coordination service (in
  # process 0, or standalone), or "etcd://HOST:PORT[,HOST:PORT...][/JOB]", a replicated etcd cluster that
  # outlives any one machine and admits processes that were never part of the job (asynchronous/etcd_kv.py).
  control: str = "jax"


def define_flags() -> None:
  """Registers the flags above on absl's FLAGS (called once by noloco_jax.main)."""
  flags.DEFINE_enum("distributed", None, MODES, f"Multi-process job: auto | on | off ({ENV['mode']}; default auto).")
  flags.DEFINE_string("coordinator_address", None, f"host:port of process 0 ({ENV['coordinator_address']}).")
  flags.DEFINE_integer("num_processes", None, f"Processes in the job ({ENV['num_processes']}).")
  flags.DEFINE_integer("process_id", None, f"This process's index, 0 … num_processes−1 ({ENV['process_id']}).")
  flags.DEFINE_integer("heartbeat_timeout_s", None, f"Seconds before a silent process is declared dead "
                       f"({ENV['heartbeat_timeout_s']}; default {Options.heartbeat_timeout_s}).")
  flags.DEFINE_integer("initialization_timeout_s", None, f"Seconds to wait for all processes at start-up "
                       f"({ENV['initialization_timeout_s']}; default {Options.initialization_timeout_s}).")
  flags.DEFINE_integer("shutdown_timeout_s", None, f"Seconds a finished process waits for the others "
                       f"({ENV['shutdown_timeout_s']}; default {Options.shutdown_timeout_s}).")
  flags.DEFINE_integer("standalone_service", None, "outer.schedule='async': 1 = the coordination service runs in "
                       "a process of its own at --coordinator_address (python -m noloco_jax.asynchronous.control "
                       f"--port=PORT --num_processes=P), so that process 0 may die like any other "
                       f"({ENV['standalone_service']}; default 0).")
  flags.DEFINE_string("control", None, "outer.schedule='async': the control plane, 'jax' (JAX's coordination service "
                      "at --coordinator_address) or etcd://HOST:PORT[,HOST:PORT...][/JOB] (a replicated etcd cluster: "
                      "survives the loss of any one member, and a process started without --process_id joins the "
                      f"running job in a free slot) ({ENV['control']}; default jax).")


def resolve_options(environ=None, **given) -> Options:
  """Options from explicit values (None = not given), then NOLOCO_* environment variables, then defaults."""
  environ = os.environ if environ is None else environ
  values: dict[str, Any] = {}
  for field in dataclasses.fields(Options):
    value = given.get(field.name)
    if value is None and environ.get(ENV[field.name], "") != "":
      raw = environ[ENV[field.name]]
      try:
        value = raw if field.name in ("mode", "coordinator_address", "control") else int(raw)
      except ValueError:
        raise ValueError(f"{ENV[field.name]}={raw!r} is not valid: an integer is needed.") from None
    if value is not None:
      values[field.name] = value
  options = Options(**values)
  if options.mode not in MODES:
    raise ValueError(f"distributed mode {options.mode!r} is not valid; choose one of {MODES}.")
  if options.control != "jax" and not options.control.startswith("etcd://"):
    raise ValueError(f"--control={options.control!r} is not valid: 'jax' (JAX's coordination service) or "
                     "etcd://HOST:PORT[,HOST:PORT...][/JOB] (an etcd cluster's client URLs).")
  return options


def options_from_flags(flag_values) -> Options:
  """main.py's options; an invalid value (e.g. NOLOCO_NUM_PROCESSES=two) is one line and exit status 2."""
  try:
    return resolve_options(**{f.name: getattr(flag_values, "distributed" if f.name == "mode" else f.name)
                              for f in dataclasses.fields(Options)})
  except ValueError as e:
    cli.exit_usage(str(e))
