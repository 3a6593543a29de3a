"""Reading an asynchronous job: its per-process logs, merged by the reader (no process writes for another).

Each process of a job run with `outer.schedule='async'` writes into WORKDIR/process_<i>/ (asynchronous/job.py):
`metrics.jsonl` (its training and evaluation rows), `pairings_<i>.jsonl` (every round: its group, the
partners' progress, the wait, the exchange, or why it was skipped) and `membership_<i>.jsonl` (who it saw
join, leave or be lost, and when; whom it served or joined from). `merge` reads them all:

    python -m noloco_jax.asynchronous.logs runs/async            # one line per process
    python -m noloco_jax.asynchronous.logs runs/async --out=DIR  # and the merged rows as JSONL files

Merged metrics rows carry `process`; pairings and membership events are ordered by time (each
process's own clock; hosts' clocks need not agree, so the order across hosts is approximate). Times
are printed relative to the job's start, the first event any process logged.

How each process ended: `finished` (its last training row is at config.num_steps), `lost` (its lease ran
out: it died or stalled, liveness.py) or `stopped` (it left the rounds before the last step: SIGTERM, or an
error of its own). A process that finished leaves the rounds too (the `left` event of its peers' logs):
it is named as finished, not as left.

`job_rows` is the job's own series, what a lock-step job's metrics.jsonl would hold: at every logged
step the mean over the processes that logged it (a process's rows hold its one replica, so the mean is
the lock-step job's mean over replicas), perf/steps_per_s the slowest process's, perf/tokens_per_s their
sum. A process's replicas/weight_std
(0: one replica) and its eval/consensus_* (its own φ) say nothing about the job and are left out: the
job's spread and consensus model are asynchronous/result.py's. Nothing here imports JAX (report.py
reads a job through this module).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

PROCESS_DIR = re.compile(r"process_(\d+)")  # a process's run in a job's workdir
# Per-process figures that are not the job's (see the module docstring).
NOT_THE_JOBS = ("replicas/weight_std", "eval/consensus_loss", "eval/consensus_ppl")
ENDS = ("lost", "left", "returned", "joined_from")  # the membership events summary() lists


def _jsonl(path: str) -> list[dict]:
  """The rows of a JSONL log; none when it does not exist (yet); a line cut by a crash is left out."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict):
        rows.append(row)
  return rows


def processes(workdir: str) -> list[int]:
  """The process slots that have a directory in `workdir`, ascending."""
  found = []
  for path in glob.glob(os.path.join(workdir, "process_*")):
    match = PROCESS_DIR.fullmatch(os.path.basename(path))
    if match and os.path.isdir(path):
      found.append(int(match.group(1)))
  return sorted(found)


def is_job(workdir: str) -> bool:
  """Whether `workdir` is the workdir of an asynchronous job (it holds process_<i>/, no checkpoints/ of its own)."""
  return bool(processes(workdir)) and not os.path.isdir(os.path.join(workdir, "checkpoints"))


def merge(workdir: str) -> dict:
  """{"metrics", "pairings", "membership": [...], "processes": [...], "configs": {slot: config}} of the job."""
  slots = processes(workdir)
  if not slots:
    raise FileNotFoundError(f"{workdir} holds no process_<i> directory: not the workdir of an asynchronous job "
                            "(config.outer.schedule='async').")
  metrics, pairings, membership, configs = [], [], [], {}
  for slot in slots:
    d = os.path.join(workdir, f"process_{slot}")
    metrics += [{**r, "process": slot} for r in _jsonl(os.path.join(d, "metrics.jsonl")) if "step" in r]
    pairings += [p for p in _jsonl(os.path.join(d, f"pairings_{slot}.jsonl")) if "time" in p]
    membership += [{"observer": slot, **r} for r in _jsonl(os.path.join(d, f"membership_{slot}.jsonl"))]
    try:
      with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        configs[slot] = json.load(f)
    except (OSError, ValueError):
      configs[slot] = {}
  metrics.sort(key=lambda r: (r["step"], r["process"]))
  pairings.sort(key=lambda r: r["time"])
  membership.sort(key=lambda r: r.get("time", 0.0))
  return {"processes": slots, "metrics": metrics, "pairings": pairings, "membership": membership, "configs": configs}


def job_start(merged: dict) -> float | None:
  """The job's start by the processes' clocks: the earliest event any of them logged (None: none yet)."""
  times = [e["time"] for e in merged["membership"] + merged["pairings"] if isinstance(e.get("time"), (int, float))]
  return min(times) if times else None


def last_step(merged: dict, slot: int) -> int:
  """The step of the process's last training row (0 before its first)."""
  return max((r["step"] for r in merged["metrics"] if r["process"] == slot and "train/loss" in r), default=0)


def num_steps(merged: dict, slot: int) -> int | None:
  return merged["configs"].get(slot, {}).get("num_steps")


def ending(merged: dict, slot: int) -> str:
  """How process `slot` ended, by its logs: finished | lost | stopped | running (no end seen yet)."""
  step, total = last_step(merged, slot), num_steps(merged, slot)
  if total is not None and step >= total:
    return "finished"
  about = [e for e in merged["membership"] if e.get("slot") == slot and e.get("event") in ("lost", "left", "joined",
                                                                                         "returned")]
  last = about[-1]["event"] if about else None
  return {"lost": "lost", "left": "stopped"}.get(last, "running")


def _when(t: float, start: float | None) -> str:
  return f"+{t - start:.1f} s" if start is not None else f"at {t:.1f}"


def summary(merged: dict) -> list[str]:
  """One line per process (its last step, how it ended, its last validation loss, its rounds), then one line
  per membership event that matters (lost, left or finished, returned, joined from a peer), each once, with
  the processes that saw it and the first time one did, relative to the job's start."""
  lines, start = [], job_start(merged)
  for slot in merged["processes"]:
    rows = [r for r in merged["metrics"] if r["process"] == slot]
    evals = [r for r in rows if "eval/loss" in r]
    rounds = [p for p in merged["pairings"] if p.get("slot") == slot]
    count = lambda status: sum(p.get("status") == status for p in rounds)
    total = num_steps(merged, slot)
    last_eval = f"eval/loss {evals[-1]['eval/loss']:.4f} (step {evals[-1]['step']})" if evals else "no evaluation"
    lines.append(f"process {slot}: {ending(merged, slot)} at step {last_step(merged, slot)}"
                 f"{f' of {total}' if total else ''}, {last_eval}, rounds: {count('exchanged')} exchanged, "
                 f"{count('skipped')} skipped, {count('failed')} failed")
  seen: dict[tuple, list[dict]] = {}
  for e in merged["membership"]:
    if e.get("event") in ENDS:
      seen.setdefault((e.get("slot"), str(e.get("incarnation")), e["event"]), []).append(e)
  for (slot, _, event), sightings in sorted(seen.items(), key=lambda kv: kv[1][0].get("time", 0.0)):
    first = sightings[0]
    if event == "joined_from":
      what = f"joined from slot {first.get('donor')}"
    elif event == "left":  # the rounds' end of a process that finished, or of one stopped early
      what = ("finished" if ending(merged, slot) == "finished" else
              f"stopped before its last step (left the rounds at step ≤ {last_step(merged, slot)})")
    else:
      what = event
    observers = sorted({s["observer"] for s in sightings})
    lines.append(f"  slot {slot} {what} (seen by process{'es' if len(observers) > 1 else ''} "
                 f"{', '.join(map(str, observers))}, first {_when(first.get('time', 0.0), start)})")
  return lines


def job_rows(merged: dict) -> list[dict]:
  """The job's series: per logged step, the mean over the processes that logged it (module docstring).

  Training and evaluation rows are merged separately (a lock-step metrics.jsonl keeps them apart too);
  each merged row carries `job/processes`, how many processes it averages."""
  groups: dict[tuple, list[dict]] = {}
  for r in merged["metrics"]:
    kind = "train" if "train/loss" in r else "eval" if "eval/loss" in r else None
    if kind is not None:
      groups.setdefault((r["step"], kind), []).append(r)
  out = []
  for (step, kind), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "train")):
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                  - {"step", "process", *NOT_THE_JOBS})
    merged_row = {"step": step}
    for k in keys:
      values = [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))]
      if k == "perf/tokens_per_s":  # the job's: every process trains at once
        merged_row[k] = sum(values)
      else:
        merged_row[k] = min(values) if k.startswith("perf/") else sum(values) / len(values)
    if "eval/loss" in merged_row:
      merged_row["eval/ppl"] = math.exp(min(merged_row["eval/loss"], 700.0))
    merged_row["job/processes"] = len(rows)
    out.append(merged_row)
  return out


def job_config(merged: dict) -> dict:
  """The job's config as a lock-step run's config.json would hold it: a process's, with `num_replicas` the
  number of processes (each process's own config holds its one replica)."""
  config = next((c for c in merged["configs"].values() if c), {})
  return {**config, "num_replicas": len(merged["processes"])} if config else {}


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
