"""Start-up checks of a multi-process job that need the processes to exchange text.

- `check_shared_workdir`: every process must write to ONE directory. Processes given different
  --workdir values, or one path on disks that are not shared, each see only their own checkpoints;
  orbax's multi-process save then waits forever for files that never appear (a job trained, then hung
  at its first save, ignoring SIGTERM). So process 0 writes a marker with a random name into its
  workdir and every process looks for it in its own: a process that cannot see it is not sharing the
  directory. Comparing the path strings would not do: one shared filesystem may be mounted at
  different paths on different hosts, and one path on two hosts may name two local disks.
- `config_differences`: when the processes' config hashes differ, which fields differ, and how.

Both exchange text through `gather_texts`, a host-side all-gather that runs before (and independently
of) the training mesh, so it works even when the processes disagree on the config.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time

import jax
import numpy as np

MARKER_PREFIX = ".noloco_shared_check."  # + a random token; removed by process 0 once all have looked
WAIT_S = 5.0  # how long a process looks for the marker (a shared filesystem may show new files late)
_MAX_LISTED = 12  # differing config fields named in one error


def gather_texts(text: str) -> list[str]:
  """Every process's `text`, in process order (a collective: every process must call it)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(text.encode(), np.uint8)
  # process_allgather needs one shape on every process: gather the lengths, then pad to the longest.
  lengths = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:raw.size] = raw
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
  return [rows[p, :lengths[p]].tobytes().decode() for p in range(len(lengths))]


# ---------------------------------------------------------------------------------------------------
# Config differences.
# ---------------------------------------------------------------------------------------------------


def flatten_config(config) -> dict[str, str]:
  """{"inner.lr": "0.003", "outer.kind": '"noloco"', ...}: every leaf field, its value as JSON text."""
  flat: dict[str, str] = {}

  def walk(node, prefix):
    for key in sorted(node):
      value = node[key]
      if hasattr(value, "items"):
        walk(value, f"{prefix}{key}.")
      else:
        flat[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=str)

  walk(config.to_dict() if hasattr(config, "to_dict") else config, "")  # a typed config, a ConfigDict, or dicts
  return flat


def config_differences(flat_configs: list[dict[str, str]], processes: list[int] | None = None) -> list[str]:
  """One line per field on which the processes disagree: 'inner.lr: processes [0] have 0.003; ...'.
  `processes`: the process (slot) of each config (default: their positions)."""
  lines = []
  processes = list(range(len(flat_configs))) if processes is None else processes
  for field in sorted(set().union(*flat_configs)):
    by_value: dict[str, list[int]] = {}
    for p, flat in zip(processes, flat_configs):
      by_value.setdefault(flat.get(field, "(absent)"), []).append(p)
    if len(by_value) > 1:
      lines.append(f"{field}: " + "; ".join(f"processes {procs} have {value}" for value, procs in by_value.items()))
  return lines


def describe_config_mismatch(config) -> str:
  """Collective: the fields that differ between the processes' configs (`config`: this process's, as nested
  dicts), as one line."""
  flats = [json.loads(t) for t in gather_texts(json.dumps(flatten_config(config)))]
  lines = config_differences(flats)
  if not lines:  # equal fields, different hashes: the JSON text differs in something else
    return "config differs (in its serialised text, not in any field)"
  more = f" (and {len(lines) - _MAX_LISTED} more fields)" if len(lines) > _MAX_LISTED else ""
  return "config differs in " + " | ".join(lines[:_MAX_LISTED]) + more


# ---------------------------------------------------------------------------------------------------
# One shared workdir.
# ---------------------------------------------------------------------------------------------------


def _wait_for(path: str, token: str, wait_s: float) -> bool:
  deadline = time.monotonic() + wait_s
  while True:
    try:
      with open(path) as f:
        if f.read().split("\n", 1)[0] == token:
          return True
    except OSError:
      pass
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.1)


def shared_workdir_problem(workdir: str, wait_s: float = WAIT_S) -> str | None:
  """Collective. None when every process sees process 0's marker in its workdir; else why not (one line).

  The workdir must exist on every process. Process 0 writes the marker BEFORE the gather that hands
  its name to the others, so no process looks for it too early; it removes the marker once every
  process has reported (the second gather), so a successful check leaves the workdir as it was.
  """
  path = os.path.abspath(workdir)
  me = jax.process_index()
  token = ""
  if me == 0:
    token = secrets.token_hex(8)
    with open(os.path.join(path, MARKER_PREFIX + token), "w") as f:
      f.write(f"{token}\nwritten by process 0 on {socket.gethostname()} pid {os.getpid()}\n")
  token = gather_texts(token)[0]
  marker = os.path.join(path, MARKER_PREFIX + token)
  sees = _wait_for(marker, token, wait_s)
  reports = [json.loads(t) for t in gather_texts(json.dumps({"host": socket.gethostname(), "workdir": path,
                                                             "sees": sees}))]
  if me == 0:
    try:
      os.remove(marker)
    except OSError:
      pass
  blind = [p for p, r in enumerate(reports) if not r["sees"]]
  if not blind:
    return None
  where = "; ".join(f"process {p} on {reports[p]['host']} uses {reports[p]['workdir']}" for p in blind)
  return (f"workdir is not one shared directory: process 0 on {reports[0]['host']} wrote a marker into "
          f"{reports[0]['workdir']}, which processes {blind} do not see in their workdir within {wait_s:.0f} s "
          f"({where}). Give every process the same --workdir, on a filesystem all hosts share")
