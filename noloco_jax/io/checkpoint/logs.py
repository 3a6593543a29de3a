"""The run's JSON-lines logs (metrics.jsonl, pairings.jsonl, elastic.jsonl): durable rows, each exactly once after a resume.

The promises (docs/running.md, "Resume is exact"): every row is on disk no later than the checkpoint that
covers it (rows are line-buffered, and the loop calls `sync`, which fsyncs, before it starts a save);
after a resume each row appears once (`rewrite_for_resume` keeps the rows up to the restored step and
drops repeats; `start_afresh` empties the logs of a run starting from scratch); a damaged log never
stops a run (a line that is not a row is named with its file and line and left out; missing rows are
named and rebuilt where known: log_repair.py). Rows are keyed by "step"; two rows are the same when
they have the same step and fields. Rewrites are atomic (a temporary file renamed over the old one).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

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


def parse_row(line: str) -> dict | None:
  """The row a line holds, or None when the line is not a row (not JSON, not an object, no integer "step")."""
  try:
    row = json.loads(line)
  except ValueError:  # JSONDecodeError, and bytes that are not UTF-8
    return None
  if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
    return None
  return row


@dataclasses.dataclass
class LogFile:
  """One log as read for a resume: its rows, and the lines that are not rows."""
  path: str
  rows: list[tuple[dict, str]]  # (row, its line, newline-terminated), in file order
  damaged: list[tuple[int, str]]  # (line number from 1, the line) of lines that are not rows
  cut: str | None  # an unterminated last line that is not a row: its writer was killed while writing it

  @classmethod
  def read(cls, path: str) -> LogFile:
    rows, damaged, cut = [], [], None
    if os.path.exists(path):
      with open(path, errors="replace") as f:
        lines = f.readlines()
      for number, line in enumerate(lines, 1):
        if not line.strip():
          continue
        row = parse_row(line)
        if row is not None:
          rows.append((row, line if line.endswith("\n") else line + "\n"))
        elif number == len(lines) and not line.endswith("\n"):
          cut = line
        else:
          damaged.append((number, line.rstrip("\n")))
    return cls(path, rows, damaged, cut)


def _row_key(row: dict) -> tuple:
  return row["step"], tuple(sorted(row))


def _rewrite(path: str, keep: list[str]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)  # atomic: a crash here leaves either the old or the new file


@dataclasses.dataclass
class Rewrite:
  """What `rewrite_for_resume` did to one log."""
  late: int = 0  # rows after the restored step, dropped (the resumed run writes them again)
  repeats: int = 0  # rows kept once that were there twice
  damaged: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (line number, line), dropped
  cut: bool = False  # an incomplete last line, dropped


def rewrite_for_resume(path: str, step: int, once: bool = True) -> Rewrite:
  """Keeps each row with "step" ≤ `step` once, and nothing else; says what it dropped. `once=False`: a log
  whose rows may share a step and their fields (a membership log's events) keeps those too."""
  log = LogFile.read(path)
  keep, seen, done = [], set(), Rewrite(damaged=log.damaged, cut=log.cut is not None)
  for row, line in log.rows:
    if row["step"] > step:
      done.late += 1
    elif once and _row_key(row) in seen:
      done.repeats += 1
    else:
      seen.add(_row_key(row))
      keep.append(line)
  if done.late or done.repeats or done.damaged or done.cut:
    _rewrite(path, keep)
  return done


def add_rows(path: str, rows: list[dict], order: Callable[[dict], int] = lambda row: 0) -> None:
  """Inserts `rows` among the file's rows in step order, atomically. Within a step, `order(row)` says
  where a row goes among the rows of its step: after those of a lower or equal order, before the rest
  (the default puts it after every row of its step)."""
  kept = LogFile.read(path).rows
  lines, keys = [line for _, line in kept], [(row["step"], order(row)) for row, _ in kept]
  for row in sorted(rows, key=lambda r: (r["step"], order(r))):
    key = (row["step"], order(row))
    at = next((i for i, k in enumerate(keys) if k > key), len(keys))
    lines.insert(at, json.dumps(row) + "\n")
    keys.insert(at, key)
  _rewrite(path, lines)


def replace_row(path: str, row: Mapping[str, Any]) -> None:
  """Appends `row` after removing any row with its step and fields: a one-off row (io/checkpoint/
  resize.py's events) is there once however often its resume is repeated, the latest attempt's."""
  key = _row_key(dict(row))
  keep = [line for r, line in LogFile.read(path).rows if _row_key(r) != key]
  _rewrite(path, keep + [json.dumps(dict(row)) + "\n"])


def start_afresh(path: str) -> int:
  """Empties the log at `path`; returns how many rows (lines) it held."""
  if not os.path.exists(path):
    return 0
  with open(path, errors="replace") as f:
    count = sum(1 for line in f if line.strip())
  if count:
    _rewrite(path, [])
  return count


def _paths(workdir: str) -> list[str]:
  """The logs to rewrite: process 0 alone writes them, the others leave them alone."""
  return [os.path.join(workdir, name) for name in LOG_FILES] if jax.process_index() == 0 else []


def _shown(line: str, limit: int = 80) -> str:
  return repr(line if len(line) <= limit else line[:limit] + "...")


def truncate_logs(workdir: str, step: int) -> None:
  """On resume: each log's rows up to `step`, once; warns for what was dropped (then log_repair.py)."""
  for path in _paths(workdir):
    done = rewrite_for_resume(path, step)
    if done.late:
      logging.warning("resume: dropped %d row(s) of %s written after step %d by the earlier run; they are "
                      "written again from here.", done.late, path, step)
    if done.repeats:
      logging.warning("resume: dropped %d repeated row(s) of %s (steps logged twice by an earlier run).",
                      done.repeats, path)
    if done.cut:
      logging.warning("resume: dropped the incomplete last line of %s (its writer was stopped while writing it).",
                      path)
    for number, line in done.damaged[:5]:
      logging.warning("resume: %s line %d is damaged (not a JSON object with an integer \"step\"): %s; dropped.",
                      path, number, _shown(line))
    if len(done.damaged) > 5:
      logging.warning("resume: %s had %d more damaged line(s), also dropped.", path, len(done.damaged) - 5)


def start_logs_afresh(workdir: str) -> None:
  """On a start from scratch: empties logs left by a run that completed no checkpoint, warning."""
  for path in _paths(workdir):
    if count := start_afresh(path):
      logging.warning("start: %s held %d row(s) of an earlier run that completed no checkpoint; this run "
                      "starts from scratch, so they were dropped.", path, count)
