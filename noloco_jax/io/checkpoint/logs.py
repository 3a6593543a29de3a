"""Resuming rewrites the row logs: rows the interrupted run wrote after the restored step are dropped.

`metrics.jsonl` and `pairings.jsonl` hold one JSON row per line keyed by "step". Rows past the
checkpoint (and a last line cut by the kill) are dropped when the run resumes, with a warning saying
how many; the resumed run then writes those steps again, identically. TensorBoard event files are
append-only and keep the interrupted run's points past the checkpoint.
"""

from __future__ import annotations

import json
import os

from absl import logging
import jax

LOG_FILES = ("metrics.jsonl", "pairings.jsonl")  # rows keyed by "step", rewritten on resume


def drop_rows_after(path: str, step: int) -> int:
  """Rewrites a JSONL log keeping the rows with "step" ≤ `step`; returns how many were dropped.

  A line that does not parse (the last line of a killed writer) is dropped and counted too.
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if int(row.get("step", 0)) <= step:
      keep.append(line if line.endswith("\n") else line + "\n")
  dropped = len([l for l in lines if l.strip()]) - len(keep)
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, path)  # atomic: a crash here leaves either the old or the new file
  return dropped


def truncate_logs(workdir: str, step: int) -> None:
  """Drops every log's rows after `step` (process 0 only: it alone writes them), warning for each."""
  if jax.process_index() != 0:
    return
  for name in LOG_FILES:
    path = os.path.join(workdir, name)
    if (dropped := drop_rows_after(path, step)):
      logging.warning("resume: dropped %d row(s) of %s written after step %d by the interrupted run; "
                      "they are written again from here.", dropped, path, step)
