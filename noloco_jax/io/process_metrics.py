"""Training metrics with no job-wide barrier: each process logs its own replicas, process 0 merges.

Reading a per-replica metric whole needs an all-gather over every process: logging that way every
`log_every` steps would put a global barrier into a NoLoCo run, whose replicas wait only for their
partners. What is written where and how rows are merged: docs/running.md ("No job-wide barrier"). Here:

  * `local_fetch` reads only the shards this process's devices hold (no collective);
  * `ProcessLog.write_train` appends this process's row to workdir/metrics/process_<i>.jsonl. Each
    attempt empties its own file first (rows of a killed attempt would be written again; merging both
    lost every row after the dead run's last one), then all processes pass one barrier, so that process 0
    never reads a file before its writer has emptied it;
  * process 0 merges, at its own log steps and without waiting, the steps every process has logged,
    oldest first; after a barrier (an evaluation) `sync` merges every row before the evaluation row, so
    metrics.jsonl stays in step order.

One process needs none of this: `local_fetch` then reads every replica and no per-process file is written.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np
from jax.experimental import multihost_utils

MEAN_KEYS = ("train/loss", "train/grad_norm", "outer/pseudo_grad_norm")
LOCAL_COUNT = "replicas/local"  # the number of replicas a per-process row averages


def local_fetch(tree, replica_ids: list[int], num_replicas: int):
  """NumPy copies of this process's replicas of every [N, ...] leaf (rows `replica_ids`, in order).

  Reads addressable shards only, so no collective runs whatever the sharding. Leaves that are not
  per-replica (no leading axis of size N: e.g. a scalar) are copied as they are when this process can
  read them whole. With every replica local (one process) this is a plain copy, bit for bit.
  """
  def one(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      rows = {}
      for shard in x.addressable_shards:  # fsdp copies of one replica's rows are the same rows
        start = (shard.index[0].start or 0) if shard.index else 0
        data = np.asarray(shard.data)
        for i in range(data.shape[0]):
          rows.setdefault(start + i, data[i])
      missing = [r for r in replica_ids if r not in rows]
      if missing:
        raise ValueError(f"local_fetch: replicas {missing} are not on this process (array {x.shape}, {x.sharding}).")
      return np.stack([rows[r] for r in replica_ids])
    a = np.asarray(x)
    if a.ndim and a.shape[0] == num_replicas and len(replica_ids) < num_replicas:
      return a[np.asarray(replica_ids)]
    return a
  return jax.tree.map(one, tree)


def merge_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """One job-wide row from the per-process rows of one step (see the module docstring)."""
  counts = np.asarray([row[LOCAL_COUNT] for row in rows], np.float64)
  merged = {k: v for k, v in rows[0].items() if k not in (LOCAL_COUNT, "time")}
  for key in MEAN_KEYS:
    if key in rows[0]:
      values = np.asarray([float(row[key]) for row in rows], np.float64)
      merged[key] = float(np.sum(values * counts) / np.sum(counts))
  for key in rows[0]:
    if key.startswith("perf/"):
      merged[key] = min(float(row[key]) for row in rows)
  return merged


class ProcessLog:
  """This process's training rows, and (process 0) the merge of every process's rows into `writer`.

  In a multi-process job every process must construct it at the same point (its constructor holds a
  barrier: see the module docstring).
  """

  def __init__(self, workdir: str, writer, num_local: int, process_index: int | None = None,
               process_count: int | None = None, start_step: int = 0):
    self._writer, self._num_local = writer, num_local
    # A resumed run writes new files: rows of the failed attempt after its checkpoint (already in
    # the old files) must not be merged again, and no process may have to wait for another to clean up.
    self._suffix = f".resumed_at_{start_step}" if start_step else ""
    self._index = jax.process_index() if process_index is None else process_index
    self._count = jax.process_count() if process_count is None else process_count
    self._dir = os.path.join(workdir, "metrics")
    self._file = None
    if self._count > 1:
      os.makedirs(self._dir, exist_ok=True)
      # Emptied: rows an earlier attempt left in this attempt's file are written again by this one.
      open(self.path(self._index), "w").close()
      # Line-buffered: a row is in the file (visible to process 0) as soon as it is written.
      self._file = open(self.path(self._index), "a", buffering=1)
      if jax.process_count() > 1:  # no process reads another's file before its writer has emptied it
        multihost_utils.sync_global_devices("noloco_jax.io.process_metrics.start")
    self._offsets = [0] * self._count  # bytes of each process's file already read (process 0)
    self._arrived: dict[int, dict[int, dict]] = {}  # step -> {process: row}

  def path(self, process: int) -> str:
    return os.path.join(self._dir, f"process_{process}{self._suffix}.jsonl")

  def write_train(self, step: int, scalars: dict[str, Any]) -> None:
    """Logs one training row: directly with one process; else this process's row, then the merge."""
    if self._file is None:
      self._writer.write_scalars(step, scalars)
      return
    row = {"step": int(step), **{k: _json_float(v) for k, v in scalars.items()},
           LOCAL_COUNT: self._num_local, "time": time.time()}
    self._file.write(json.dumps(row) + "\n")
    if self._index != 0:
      self._writer.write_scalars(step, scalars)  # this process's log lines (not metrics.jsonl)
    self.sync()

  def sync(self) -> None:
    """Process 0: reads what has arrived and writes every step all processes have, in step order."""
    if self._file is None or self._index != 0:
      return
    for p in range(self._count):
      for row in self._read_new(p):
        self._arrived.setdefault(row["step"], {})[p] = row
    for step in sorted(self._arrived):
      if len(self._arrived[step]) < self._count:
        break  # later steps wait too: metrics.jsonl stays in step order
      rows = self._arrived.pop(step)
      merged = merge_rows([rows[p] for p in range(self._count)])
      self._writer.write_scalars(step, {k: v for k, v in merged.items() if k != "step"})

  def pending_steps(self) -> list[int]:
    """Steps some process has logged that are not merged yet (process 0)."""
    return sorted(self._arrived)

  def close(self) -> None:
    self.sync()
    if self._file is not None:
      self._file.close()
      self._file = None

  def _read_new(self, p: int) -> list[dict]:
    path = self.path(p)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      f.seek(self._offsets[p])
      text = f.read()
    complete = text[:text.rfind("\n") + 1]  # a row still being written is read next time
    self._offsets[p] += len(complete.encode())
    rows = []
    for line in complete.splitlines():
      try:
        row = json.loads(line) if line.strip() else None
      except json.JSONDecodeError:
        row = line
      if isinstance(row, dict) and isinstance(row.get("step"), int):
        rows.append(row)
      elif row is not None:  # only another writer could have put it there: never a reason to stop training
        logging.warning("metrics: skipped a damaged row of %s: %r", path, line[:200])
    return rows


def _json_float(value) -> float | str:
  value = float(np.asarray(value))
  return value if math.isfinite(value) else str(value)


def _file_attempt(name: str) -> tuple[int, int] | None:
  """(process, the step its attempt resumed at; 0 for the first) of a per-process file name."""
  stem = name[len("process_"):-len(".jsonl")] if name.startswith("process_") and name.endswith(".jsonl") else ""
  process, _, resumed = stem.partition(".resumed_at_")
  if not process.isdigit() or (resumed and not resumed.isdigit()):
    return None
  return int(process), int(resumed or 0)


def recover_rows(workdir: str, steps: list[int], num_replicas: int) -> dict[int, dict[str, Any]]:
  """{step: its merged metrics.jsonl row} for those of `steps` that every process logged in workdir/metrics.

  For a resume (io/checkpoint/log_repair.py): process 0 merges a step only once every process's row
  has arrived, so a job stopped right after a checkpoint may leave steps before it in the per-process
  files only. Rows of attempts that resumed at or after a step cannot hold it and are not read. A
  step is merged when the rows found for it cover `num_replicas` replicas (one row per process: the
  latest attempt's), as the run would have merged it; its values are then the same.
  """
  wanted, found = set(steps), {}
  directory = os.path.join(workdir, "metrics")
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  for name in sorted(names, key=lambda n: (_file_attempt(n) or (0, 0))[1]):  # later attempts last: they win
    attempt = _file_attempt(name)
    if attempt is None or attempt[1] >= max(wanted, default=0):
      continue
    with open(os.path.join(directory, name), errors="replace") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          continue
        if isinstance(row, dict) and row.get("step") in wanted and isinstance(row.get(LOCAL_COUNT), int):
          found.setdefault(row["step"], {})[attempt[0]] = row
  out = {}
  for step, by_process in found.items():
    rows = [by_process[p] for p in sorted(by_process)]
    if sum(row[LOCAL_COUNT] for row in rows) == num_replicas:
      merged = merge_rows(rows)
      out[step] = {"step": step, **{k: _json_float(v) for k, v in merged.items() if k != "step"}}
  return out
