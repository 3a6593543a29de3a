"""Reading an asynchronous job: its per-process logs, merged by the reader (no process writes for another).

Each process of a job run with `outer.schedule='async'` writes into WORKDIR/process_<i>/ (asynchronous/job.py):
`metrics.jsonl` (its training and evaluation rows), `pairings_<i>.jsonl` (every round: its group, the
partners' progress, the wait, the exchange, or why it was skipped) and `membership_<i>.jsonl` (who it saw
join, leave or be lost, and when; whom it served or joined from). `merge` reads them all:

    python -m noloco_jax.asynchronous.logs runs/async            # one line per process
    python -m noloco_jax.asynchronous.logs runs/async --out=DIR  # and the merged rows as JSONL files

Merged metrics rows carry `process`; pairings and membership events are ordered by time (each
process's own clock; hosts' clocks need not agree, so the order across hosts is approximate).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from noloco_jax.io import metrics as metrics_lib

_PROCESS = re.compile(r"process_(\d+)$")


def _jsonl(path: str) -> list[dict]:
  return metrics_lib.read_jsonl(path, missing_ok=True, skip_damaged=True)  # a line cut by a crash is left out


def processes(workdir: str) -> list[int]:
  """The process slots that have a directory in `workdir`, ascending."""
  found = []
  for path in glob.glob(os.path.join(workdir, "process_*")):
    match = _PROCESS.search(path)
    if match and os.path.isdir(path):
      found.append(int(match.group(1)))
  return sorted(found)


def merge(workdir: str) -> dict:
  """{"metrics": [...], "pairings": [...], "membership": [...], "processes": [...]} of the job in `workdir`."""
  slots = processes(workdir)
  if not slots:
    raise FileNotFoundError(f"{workdir} holds no process_<i> directory: not the workdir of an asynchronous job "
                            "(config.outer.schedule='async').")
  metrics, pairings, membership = [], [], []
  for slot in slots:
    d = os.path.join(workdir, f"process_{slot}")
    metrics += [{"process": slot, **r} for r in _jsonl(os.path.join(d, "metrics.jsonl"))]
    pairings += _jsonl(os.path.join(d, f"pairings_{slot}.jsonl"))
    membership += [{"observer": slot, **r} for r in _jsonl(os.path.join(d, f"membership_{slot}.jsonl"))]
  metrics.sort(key=lambda r: (r["step"], r["process"]))
  pairings.sort(key=lambda r: r["time"])
  membership.sort(key=lambda r: r.get("time", 0.0))
  return {"processes": slots, "metrics": metrics, "pairings": pairings, "membership": membership}


def summary(merged: dict) -> list[str]:
  """One line per process: its last step, last validation loss, rounds exchanged / skipped / failed."""
  lines = []
  for slot in merged["processes"]:
    rows = [r for r in merged["metrics"] if r["process"] == slot]
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    rounds = [p for p in merged["pairings"] if p["slot"] == slot]
    count = lambda status: sum(p["status"] == status for p in rounds)
    last_eval = f"eval/loss {evals[-1]['eval/loss']:.4f} (step {evals[-1]['step']})" if evals else "no evaluation"
    lines.append(f"process {slot}: step {train[-1]['step'] if train else 0}, {last_eval}, rounds: "
                 f"{count('exchanged')} exchanged, {count('skipped')} skipped, {count('failed')} failed")
  events = [e for e in merged["membership"] if e.get("event") in ("lost", "left", "joined_from")]
  for e in events:
    who = f"slot {e['slot']}"
    what = f"joined from slot {e['donor']}" if e["event"] == "joined_from" else e["event"]
    lines.append(f"  {who} {what} (seen by process {e['observer']} at {e['time']:.1f})")
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--out", default="", help="also write metrics.jsonl, pairings.jsonl, membership.jsonl here")
  args = parser.parse_args(argv)
  try:
    merged = merge(args.workdir)
  except FileNotFoundError as e:
    print(f"noloco_jax: {e}", file=sys.stderr)
    return 2
  print("\n".join(summary(merged)))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    for name in ("metrics", "pairings", "membership"):
      with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in merged[name])
  return 0


if __name__ == "__main__":
  sys.exit(main())
