"""The run's JSON-lines logs (metrics.jsonl, pairings.jsonl, elastic.jsonl): durable rows, each exactly once after a resume.

Two promises, kept together with the checkpointer:

- Every row is on disk no later than the checkpoint that covers it. Rows are written line-buffered
  (each reaches the operating system as it is written, so a kill -9 loses none), and the loop calls
  `sync` on every log before it starts a save, which also fsyncs them: even a machine that loses
  power after a checkpoint is complete has the rows that checkpoint covers.
- After a resume each row appears once. `rewrite_for_resume` keeps the rows up to the restored step
  (the resumed run writes the later ones again, identically) and drops repeats of a row already
  kept, a leftover of runs that lacked these guarantees. `start_afresh` empties the logs of a run
  that is starting from scratch although rows exist (killed before its first checkpoint completed).

Rows are keyed by their "step"; two rows are the same row when they have the same step and the
same fields (a train row and an eval row of one step are two rows). Rewrites are atomic (a
temporary file renamed over the old one), so a crash mid-rewrite leaves the old or the new file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from absl import logging
import jax

LOG_FILES = ("metrics.jsonl", "pairings.jsonl", "elastic.jsonl")  # rows keyed by "step", rewritten on resume


class JsonlLog:
  """Appends one JSON object per row to `path`; `sync` makes the rows written so far durable."""

  def __init__(self, path: str):
    self.path = path
    self._file = open(path, "a", buffering=1)  # line-buffered: each row reaches the OS when written

  def append(self, row: Mapping[str, Any]) -> None:
    self._file.write(json.dumps(row) + "\n")

  def sync(self) -> None:
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self) -> None:
    if not self._file.closed:
      self.sync()
      self._file.close()


def _row_key(row: dict) -> tuple:
  return int(row.get("step", 0)), tuple(sorted(row))


def _rewrite(path: str, keep: list[str]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)  # atomic: a crash here leaves either the old or the new file


def rewrite_for_resume(path: str, step: int) -> tuple[int, int]:
  """Keeps each row with "step" ≤ `step` once; returns (rows dropped as later, repeats dropped).

  A line that does not parse (the last line of a killed writer) counts as a later row.
  """
  if not os.path.exists(path):
    return 0, 0
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  keep, seen, late, repeats = [], set(), 0, 0
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      late += 1
      continue
    if int(row.get("step", 0)) > step:
      late += 1
    elif _row_key(row) in seen:
      repeats += 1
    else:
      seen.add(_row_key(row))
      keep.append(line if line.endswith("\n") else line + "\n")
  if late or repeats:
    _rewrite(path, keep)
  return late, repeats


def replace_row(path: str, row: Mapping[str, Any]) -> None:
  """Appends `row` after removing any row with its step and fields: a one-off row (io/checkpoint/
  resize.py's events) is there once however often its resume is repeated, the latest attempt's."""
  key, keep, lines = _row_key(dict(row)), [], []
  if os.path.exists(path):
    with open(path) as f:
      lines = [line for line in f if line.strip()]
  for line in lines:
    try:
      same = _row_key(json.loads(line)) == key
    except json.JSONDecodeError:
      same = False
    if not same:
      keep.append(line if line.endswith("\n") else line + "\n")
  _rewrite(path, keep + [json.dumps(dict(row)) + "\n"])


def start_afresh(path: str) -> int:
  """Empties the log at `path`; returns how many rows it held."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    count = sum(1 for line in f if line.strip())
  if count:
    _rewrite(path, [])
  return count


def _paths(workdir: str) -> list[str]:
  """The logs to rewrite: process 0 alone writes them, the others leave them alone."""
  return [os.path.join(workdir, name) for name in LOG_FILES] if jax.process_index() == 0 else []


def truncate_logs(workdir: str, step: int) -> None:
  """On resume: each log's rows up to `step`, once; warns for what was dropped."""
  for path in _paths(workdir):
    late, repeats = rewrite_for_resume(path, step)
    if late:
      logging.warning("resume: dropped %d row(s) of %s written after step %d by the interrupted run; "
                      "they are written again from here.", late, path, step)
    if repeats:
      logging.warning("resume: dropped %d repeated row(s) of %s (steps logged twice by an earlier run).",
                      repeats, path)


def start_logs_afresh(workdir: str) -> None:
  """On a start from scratch: empties logs left by a run that completed no checkpoint, warning."""
  for path in _paths(workdir):
    if count := start_afresh(path):
      logging.warning("start: %s held %d row(s) of an earlier run that completed no checkpoint; this run "
                      "starts from scratch, so they were dropped.", path, count)
