"""The checkpoint's `data/` item: one JSON file per process (`process_<i>.json`) of stream positions.

Each process writes the positions of the replicas it holds. Restore reads every file and merges
them, and each process then takes its own replicas, so a checkpoint restores under another process
count or device layout.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp

from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import records


class PerProcessJsonHandler(ocp.JsonCheckpointHandler):
  """Orbax's JSON handler, but every process writes (primary_host=None) a file of its own."""

  def __init__(self):
    super().__init__(filename=f"process_{jax.process_index()}.json",
                     multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))

  def restore(self, directory, item=None, args=None) -> dict[str, Any]:
    del item, args
    files = sorted(directory.glob("process_*.json"))
    if not files:
      raise FileNotFoundError(f"no process_*.json in {directory}")
    return {f.name: json.loads(f.read_text()) for f in files}


@ocp.args.register_with_handler(PerProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class PerProcessJsonSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(PerProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class PerProcessJsonRestore(ocp.args.CheckpointArgs):
  pass


def restore_items(manager, step: int) -> tuple[dict, dict]:
  """(meta record, {file name: data file}) of `step`, checked as saved: their digests (checksum.py), then the
  meta's format and step. The resume (restoring.py) and the checkpoint reader (read.py) check a step alike."""
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  data = manager.restore(step, args=ocp.args.Composite(data=PerProcessJsonRestore()))["data"]
  old_format = isinstance(meta, dict) and meta.get("format") == records.FORMAT_WITHOUT_DIGESTS
  checksum.verify_items(meta, data, step, digests_required=not old_format)
  if meta.get("format") not in (records.FORMAT, records.FORMAT_WITHOUT_DIGESTS) or meta.get("step") != step:
    raise ValueError(f"meta item: format {meta.get('format')!r}, step {meta.get('step')!r}")
  return meta, data


def merge_data_states(files: dict[str, Any]) -> dict:
  """One iterator state holding every replica of the job, from the per-process files."""
  states = [f["iterator"] for f in files.values()]
  merged = {**states[0], "replicas": {}}
  for s in states:
    if s.get("format") != merged.get("format") or s.get("config") != merged.get("config"):
      raise ValueError(f"data item: process files disagree: {s.get('config')} vs {merged.get('config')}")
    merged["replicas"].update(s["replicas"])
  return merged
