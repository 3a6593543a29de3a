"""On resume: which log rows from before the restored step are missing, and the ones that can be rebuilt.

A log can lose rows that a checkpoint covers: a metrics.jsonl emptied or cut by hand, a pairings.jsonl
truncated, a multi-process job stopped right after a checkpoint before process 0 had merged every
process's rows (io/process_metrics.py). The resumed run writes only the rows after its step, so such
gaps stayed unnoticed. `repair` (process 0, after logs.truncate_logs) compares each log with what the
checkpoint says it must hold and, for each kind of row:

- evaluation rows: the checkpoint's history holds every evaluation's scalars: rebuilt exactly;
- the run's first row (`model/num_params` at step 0, written once by a run that starts afresh): rebuilt
  from the model, whose size a resumed run shares with the checkpoint;
- training rows (every `log_every` steps, as the checkpoint's config logged them): merged again from
  the per-process files where every process's row is there; the rest are reported missing (a
  checkpoint keeps only the last training row; TensorBoard's event files may still hold them);
- pairing rows (one per round): rebuilt from the pairing schedule, which derives every round's groups
  from (seed, round), when the rows that survived are exactly what the schedule gives (so the rebuilt
  ones are too) and no elastic resize changed the schedule on the way; otherwise reported.

Nothing here stops a run: what is missing and what was rebuilt is said in warnings.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

from absl import logging
import jax

from noloco_jax.io import process_metrics
from noloco_jax.io.checkpoint import logs


@dataclasses.dataclass(frozen=True)
class Expected:
  """What the logs hold up to the restored step, as the checkpoint records it."""
  step: int  # the restored step
  evals: list[dict]  # every evaluation's {"step", scalars...} (the checkpoint's history)
  log_every: int  # the checkpoint's config: a training row every log_every steps
  num_replicas: int  # replicas of the checkpoint (a merged training row covers them all)
  rounds: int  # outer rounds completed by the restored step
  inner_steps: int  # H of the checkpoint's config: round r ends at step (r + 1)·H
  # (round, step) -> its pairings.jsonl row; None where the rows cannot be rebuilt (an elastic resume)
  pairing_row: Callable[[int, int], dict] | None
  num_params: int | None = None  # parameters per replica (the step-0 row); None: not checked


def _ranges(steps: list[int]) -> str:
  """Steps in words: a few listed ("3, 6, 15"), more as evenly spaced runs ("3-99 every 3, 150")."""
  if len(steps) <= 4:
    return ", ".join(str(s) for s in steps) or "none"
  pieces, i = [], 0
  while i < len(steps):
    j = i + 1
    gap = steps[j] - steps[i] if j < len(steps) else 0
    while j + 1 < len(steps) and steps[j + 1] - steps[j] == gap:
      j += 1
    if j < len(steps) and j - i >= 2:  # a run of three or more, evenly spaced
      pieces.append(f"{steps[i]}-{steps[j]}" + (f" every {gap}" if gap > 1 else ""))
      i = j + 1
    else:
      pieces.append(str(steps[i]))
      i += 1
  return ", ".join(pieces[:6]) + (" ..." if len(pieces) > 6 else "")


def _json_value(value):
  value = float(value)
  return value if math.isfinite(value) else str(value)


# A history["eval"] entry holds the scalars of two rows, written at the same barrier by two plug-ins
# (training/plugins/): the evaluation's (eval/loss, eval/ppl, replicas/weight_std), then the consensus
# model's (eval/consensus_*). Within a step the rows come in that order, after the training row.
CONSENSUS = "eval/consensus_"
NUM_PARAMS = "model/num_params"  # the step-0 row of a run started afresh (training/plugins/train_log.py)
TRAIN, EVAL, CONSENSUS_EVAL = 0, 1, 2


def _row_kind(row: dict) -> int:
  return CONSENSUS_EVAL if any(k.startswith(CONSENSUS) for k in row) else EVAL if "eval/loss" in row else TRAIN


def _eval_rows(entry: dict) -> list[dict]:
  """The metrics.jsonl rows of a history["eval"] entry (io/writers.py JsonlWriter), as they were written."""
  step = int(entry["step"])
  scalars = {k: _json_value(v) for k, v in entry.items() if k != "step"}
  own = {k: v for k, v in scalars.items() if not k.startswith(CONSENSUS)}
  consensus = {k: v for k, v in scalars.items() if k.startswith(CONSENSUS)}
  return [{"step": step, **row} for row in (own, consensus) if row]


def repair_metrics(path: str, workdir: str, expected: Expected) -> None:
  rows = [row for row, _ in logs.LogFile.read(path).rows]
  have = {(r["step"], _row_kind(r)) for r in rows}
  have_train = {r["step"] for r in rows if "train/loss" in r}
  evals = [row for e in expected.evals if e["step"] <= expected.step for row in _eval_rows(e)
           if (row["step"], _row_kind(row)) not in have]
  first = ([{"step": 0, NUM_PARAMS: float(expected.num_params)}] if expected.num_params is not None and
           not any(NUM_PARAMS in r for r in rows) else [])
  every = max(expected.log_every, 1)
  missing = [s for s in range(every, expected.step + 1, every) if s not in have_train]
  recovered = process_metrics.recover_rows(workdir, missing, expected.num_replicas) if missing else {}
  if first or evals or recovered:
    logs.add_rows(path, first + evals + [recovered[s] for s in sorted(recovered)], order=_row_kind)
  if first:
    logging.warning("resume: %s lacked its first row (step 0, %s); rebuilt it from the model.", path, NUM_PARAMS)
  if evals:
    logging.warning("resume: %s lacked the evaluation row(s) of step(s) %s before the restored step %d; "
                    "rebuilt them from the checkpoint's history.", path, _ranges(sorted({r["step"] for r in evals})),
                    expected.step)
  if recovered:
    logging.warning("resume: %s lacked the training row(s) of step(s) %s; merged them again from the "
                    "per-process rows in %s.", path, _ranges(sorted(recovered)), os.path.join(workdir, "metrics"))
  lost = [s for s in missing if s not in recovered]
  if lost:
    logging.warning("resume: %s lacks %d training row(s) before the restored step %d (step(s) %s; one every "
                    "log_every=%d steps); a checkpoint keeps only the last one, so they cannot be rebuilt "
                    "(TensorBoard's event files may still hold them). Training goes on.", path, len(lost),
                    expected.step, _ranges(lost), every)


def repair_pairings(path: str, workdir: str, expected: Expected) -> None:
  rows = [row for row, _ in logs.LogFile.read(path).rows]
  by_round = {r["round"]: r for r in rows if "groups" in r and isinstance(r.get("round"), int)}
  missing = [r for r in range(expected.rounds) if r not in by_round]
  if not missing:
    return
  resized = any("elastic" in r for r in rows) or logs.LogFile.read(os.path.join(workdir, "elastic.jsonl")).rows
  rebuilt = None
  if expected.pairing_row is not None and not resized:
    rebuild = lambda r: expected.pairing_row(r, (r + 1) * expected.inner_steps)
    if all(row == rebuild(r) for r, row in by_round.items() if r < expected.rounds):
      rebuilt = [rebuild(r) for r in missing]
  if rebuilt is not None:
    logs.add_rows(path, rebuilt)
    logging.warning("resume: %s lacked the row(s) of round(s) %s before the restored step %d; rebuilt them "
                    "from the pairing schedule (every round's groups follow from the seed and the round).",
                    path, _ranges(missing), expected.step)
  else:
    why = ("an elastic resize changed the schedule" if resized or expected.pairing_row is None
           else "the rows kept differ from the schedule's")
    logging.warning("resume: %s lacks the row(s) of round(s) %s before the restored step %d; not rebuilt (%s). "
                    "Training goes on.", path, _ranges(missing), expected.step, why)


def repair(workdir: str, expected: Expected) -> None:
  """Process 0, after logs.truncate_logs: reports (and where it can, rebuilds) rows missing before the step."""
  if jax.process_index() != 0:
    return
  repair_metrics(os.path.join(workdir, "metrics.jsonl"), workdir, expected)
  if expected.rounds:
    repair_pairings(os.path.join(workdir, "pairings.jsonl"), workdir, expected)
