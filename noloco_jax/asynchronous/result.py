"""The asynchronous job's own result: for the job as a whole, what a lock-step job's summary gives.

Each process of an asynchronous job evaluates, checkpoints and summarises its one replica in
WORKDIR/process_<i>/ (job.py): no process holds the job's figures, and none can compute them while
training without a barrier. They are read afterwards from what the processes left:

  the spread       replicas/weight_std (docs/method.md §9) over the processes' θ at their last valid
                   checkpoints (io/checkpoint/read.py: verified as a resume verifies them)
  the consensus    the processes' φ at those checkpoints, averaged with the weights the method gives a
                   group's messages (outer/async_rules.py): q_k = exp(−λ · lag_k), lag_k the rounds of
                   progress process k is behind the most advanced one, λ = outer.asynchronous.staleness_decay. At equal
                   progress (every process finished, none cut off) every q_k = 1: the plain mean, the
                   lock-step job's consensus model (outer/consensus.py); a process lost early weighs little
  its loss         on the run's validation batches (the same for every process: io/data make_eval_batches)
  the rest         from the processes' logs (logs.py): the mean of each process's last evaluation and
                   last training loss, the mean bytes on the wire per replica, the rounds exchanged,
                   skipped and failed, and how each process ended (finished, lost, stopped)

    python -m noloco_jax.asynchronous.result WORKDIR    # prints the job's summary, writes WORKDIR/summary.json

The process hosting the coordination service computes it at the end of the job, once every other
process has finished or been lost (main.py); the command computes it again at any time (during the job:
from the checkpoints so far). `read` is how export_hf and sample read a workdir, a run's or a job's:
`--replica I` is process I's replica, `--consensus` the weighted consensus above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from noloco_jax import models
from noloco_jax.asynchronous import logs as logs_lib
from noloco_jax.io import data as data_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.outer import async_rules
from noloco_jax.outer import consensus as consensus_lib

PRIVATE = "async"  # the round driver's record in a checkpoint's history (training/rounds/asynchronous.py)


def progress(snap: read_lib.Snapshot) -> float:
  """The inner steps behind a process's weights at its checkpoint, as its round driver counts them
  (async_rules.merged_progress): the driver's record, advanced by the steps taken since it was set."""
  record = (snap.meta.get("history") or {}).get(PRIVATE) or {}
  if "progress" not in record:
    return float(snap.step)
  return float(record["progress"]) + (snap.step - int(record.get("progress_step", snap.step)))


def weighted_mean(stacked_NxP, weights, like_P) -> Any:
  """Σ_k q_k · x_k / Σ_k q_k over the leading axis of every leaf, in float32, in the dtype of `like_P`'s leaf."""
  q = np.asarray(weights, np.float32)

  def mean(x, like):
    total = np.tensordot(q, np.asarray(x, np.float32), axes=1)
    return (total / np.float32(q.sum())).astype(np.asarray(like).dtype)

  return jax.tree.map(mean, stacked_NxP, like_P)


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
  """Every process's newest valid checkpoint of an asynchronous job, read as one run of P replicas.

  The same interface as read_lib.Snapshot for the tools: `config` (the job's: num_replicas = processes),
  `params` / `slow` stacked [P, ...] in slot order, `weights(...)`, `replica(i)` (process i's)."""
  workdir: str
  slots: tuple[int, ...]
  snapshots: tuple[read_lib.Snapshot, ...]
  config: ml_collections.ConfigDict

  @property
  def num_replicas(self) -> int:
    return len(self.slots)

  @property
  def step(self) -> int:
    """The most advanced process's step (the steps of all: `steps`)."""
    return max(s.step for s in self.snapshots)

  @property
  def steps(self) -> dict[int, int]:
    return {slot: s.step for slot, s in zip(self.slots, self.snapshots)}

  @property
  def params(self):
    return jax.tree.map(lambda *xs: np.stack([x[0] for x in xs]), *(s.params for s in self.snapshots))

  @property
  def slow(self):
    if any(s.slow is None for s in self.snapshots):
      return None
    return jax.tree.map(lambda *xs: np.stack([x[0] for x in xs]), *(s.slow for s in self.snapshots))

  @property
  def progress(self) -> list[float]:
    return [progress(s) for s in self.snapshots]

  def consensus_weights(self) -> np.ndarray:
    """[P] float32 q_k of the processes, unnormalised (async_rules.staleness_weights of their progress)."""
    o = self.config.outer
    return async_rules.staleness_weights(self.progress, inner_steps=o.inner_steps, decay=o.asynchronous.staleness_decay)

  def replica(self, i: int) -> Any:
    if i not in self.slots:
      raise read_lib.CheckpointReadError(f"--replica={i}: the asynchronous job in {self.workdir} has processes "
                                         f"{list(self.slots)} (replica i is process i's).")
    return self.snapshots[self.slots.index(i)].replica(0)

  def weights(self, replica: int | None = None, *, consensus: bool = False, source: str = "slow") -> Any:
    """Process `replica`'s θ (default 0), or the consensus model: the mean of φ (θ with source="theta")
    weighted by the processes' progress as the method weighs a group's messages (module docstring)."""
    if not consensus:
      return self.replica(0 if replica is None else replica)
    if replica is not None:
      raise read_lib.CheckpointReadError("--replica and --consensus exclude each other: export one replica or the "
                                         "consensus model.")
    q = self.consensus_weights()
    params, slow = self.params, self.slow
    if np.all(q == q[0]):  # equal progress: the plain mean, exactly the lock-step consensus
      return jax.tree.map(np.asarray, consensus_lib.consensus_params(params, slow, source))
    like = jax.tree.map(lambda x: x[0], params)
    return weighted_mean(params if source == "theta" or slow is None else slow, q, like)

  def describe(self) -> str:
    """Which checkpoints were read, for provenance: `process 0 step 12, process 1 step 9, ...`."""
    return ", ".join(f"process {slot} step {step}" for slot, step in self.steps.items())


def job_config(config: ml_collections.ConfigDict, num_processes: int) -> ml_collections.ConfigDict:
  """The job's config from a process's (asynchronous/job.py process_config: one replica on its own devices)."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.num_replicas = num_processes
  return out


def read_job(workdir: str, step: int | None = None, *, slow: bool = True) -> JobSnapshot:
  """Every process's checkpoint of the job in `workdir`, each verified (read_lib.read: the newest valid one,
  or `step`); a process without a valid checkpoint is one CheckpointReadError naming it."""
  slots = logs_lib.processes(workdir)
  if not slots:
    raise read_lib.CheckpointReadError(f"WORKDIR={workdir!r} holds no process_<i>/ folder: not an asynchronous job.")
  snaps = []
  for slot in slots:
    try:
      snaps.append(read_lib.read(os.path.join(workdir, f"process_{slot}"), step, slow=slow))
    except read_lib.CheckpointReadError as e:
      raise read_lib.CheckpointReadError(f"process {slot} of the asynchronous job in {workdir!r}: {e}") from None
  return JobSnapshot(workdir=os.path.abspath(workdir), slots=tuple(slots), snapshots=tuple(snaps),
                     config=job_config(snaps[0].config, len(slots)))


def read(workdir: str, step: int | None = None, *, slow: bool = True) -> read_lib.Snapshot | JobSnapshot:
  """A run's checkpoint (read_lib.read) or, for the workdir of an asynchronous job, every process's."""
  if logs_lib.is_job(workdir):
    return read_job(workdir, step, slow=slow)
  return read_lib.read(workdir, step, slow=slow)


def warnings(snap: read_lib.Snapshot | JobSnapshot) -> list[str]:
  """One line per run or process whose newer checkpoints failed verification (read_lib.skipped_warning)."""
  found = snap.snapshots if isinstance(snap, JobSnapshot) else (snap,)
  return [w for w in (read_lib.skipped_warning(s) for s in found) if w]


# ---- the job's result ----


def consensus_loss(job: JobSnapshot, params) -> float:
  """The validation loss of one set of weights on the run's validation batches (outer/consensus.py)."""
  config = job.config
  vocab = config.model.vocab_size or data_lib.make_tokenizer(config.data).vocab_size  # as the run resolved it
  model = models.get(config.model.arch).resolve(config.model, vocab_size=vocab, seq_len=config.data.seq_len)
  batches = data_lib.make_eval_batches(config.data, seed=0, vocab_size=model.vocab_size)
  return float(jax.jit(lambda p, b: consensus_lib.consensus_loss(model.loss, p, b))(params, batches))


def _last(rows: list[dict], key: str) -> dict | None:
  rows = [r for r in rows if isinstance(r.get(key), (int, float))]
  return rows[-1] if rows else None


def compute(workdir: str, *, evaluate: bool = True) -> dict[str, Any]:
  """The job's summary (module docstring): the scalars WORKDIR/summary.json holds, and "text", the screen."""
  job = read_job(workdir)
  merged = logs_lib.merge(workdir)
  q = job.consensus_weights()
  per_process = {}
  for slot, snap, weight in zip(job.slots, job.snapshots, q / q.sum()):
    rows = [r for r in merged["metrics"] if r["process"] == slot]
    last_eval, last_train = _last(rows, "eval/loss"), _last(rows, "train/loss")
    per_process[slot] = {
        "ended": logs_lib.ending(merged, slot), "checkpoint_step": snap.step, "progress": progress(snap),
        "consensus_weight": float(weight),
        "eval/loss": last_eval and last_eval["eval/loss"], "eval/loss_step": last_eval and last_eval["step"],
        "train/loss": last_train and last_train["train/loss"], "train/loss_step": last_train and last_train["step"],
        **{k: (last_train or {}).get(k) for k in ("comm/bytes_sent_per_replica", "comm/bytes_received_per_replica",
                                                  "async/exchanged_rounds", "async/skipped_rounds",
                                                  "async/failed_rounds", "async/wait_s")}}

  def mean(key):
    values = [p[key] for p in per_process.values() if isinstance(p[key], (int, float))]
    return sum(values) / len(values) if values else None

  def total(key):
    return int(sum(p[key] or 0 for p in per_process.values()))

  out: dict[str, Any] = {
      "job": "asynchronous", "workdir": job.workdir, "processes": list(job.slots),
      "outer/kind": job.config.outer.kind, "num_steps": job.config.num_steps,
      "eval/loss": mean("eval/loss"), "train/loss": mean("train/loss"),
      "replicas/weight_std": float(metrics_lib.weight_std(job.params)),
      "comm/bytes_sent_per_replica": mean("comm/bytes_sent_per_replica"),
      "comm/bytes_received_per_replica": mean("comm/bytes_received_per_replica"),
      "async/exchanged_rounds": total("async/exchanged_rounds"), "async/skipped_rounds": total("async/skipped_rounds"),
      "async/failed_rounds": total("async/failed_rounds"),
      "consensus/source": "slow" if job.slow is not None else "theta",
      "per_process": {str(slot): p for slot, p in per_process.items()},
      "skipped_checkpoints": warnings(job),
  }
  if out["eval/loss"] is not None:
    out["eval/ppl"] = math.exp(min(out["eval/loss"], 700.0))
  if evaluate:
    loss = consensus_loss(job, job.weights(consensus=True))
    out.update({"eval/consensus_loss": loss, "eval/consensus_ppl": math.exp(min(loss, 700.0))})
  first = _process_summary(workdir, job.slots[0])
  for name in ("outer", "outer/exchange", "model/num_params"):  # the same in every process's summary.json
    if name in first:
      out[name] = first[name]
  start = logs_lib.job_start(merged)
  ends = [e["time"] for e in merged["membership"] + merged["pairings"] if isinstance(e.get("time"), (int, float))]
  out["wall_time_s"] = (max(ends) - start) if ends and start is not None else None
  out["text"] = _text(out, job)
  return out


def _process_summary(workdir: str, slot: int) -> dict:
  try:
    with open(os.path.join(workdir, f"process_{slot}", "summary.json"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _text(out: dict[str, Any], job: JobSnapshot) -> str:
  c, per = job.config, out["per_process"]
  fmt = lambda x, spec: "—" if x is None else format(x, spec)
  ended = ", ".join(f"{slot}: {p['ended']} (checkpoint of step {p['checkpoint_step']})" for slot, p in per.items())
  weights = ", ".join(f"{p['consensus_weight']:.3f}" for p in per.values())
  lines = [
      "=" * 72,
      f"noloco_jax asynchronous job: {c.outer.kind} | {job.num_replicas} processes, one replica each | "
      f"{c.num_steps} steps | H={c.outer.inner_steps} | model {c.model.arch} {c.model.preset}",
      f"workdir     {job.workdir} (each process's run in process_<i>/)",
      f"processes   {ended}",
      f"eval/loss   {fmt(out['eval/loss'], '.4f')} (the mean of each process's last evaluation, steps "
      f"{', '.join(str(p['eval/loss_step']) for p in per.values())})",
  ]
  if "eval/consensus_loss" in out:
    against = (f"; {out['eval/consensus_loss'] - out['eval/loss']:+.4f} against eval/loss"
               if out["eval/loss"] is not None else "")
    lines.append(f"eval/consensus_loss  {out['eval/consensus_loss']:.4f} (the processes' "
                 f"{'φ' if out['consensus/source'] == 'slow' else 'θ'} at those checkpoints, weighted by progress as "
                 f"the method weighs messages: {weights}{against})")
  lines += [
      f"train/loss  {fmt(out['train/loss'], '.4f')} (the mean of each process's last training row)",
      f"replicas/weight_std  {out['replicas/weight_std']:.3e} (across the processes' θ at those checkpoints)",
      f"comm/bytes_sent_per_replica      {fmt(out['comm/bytes_sent_per_replica'], ',.0f')} on the wire (mean over "
      "processes)",
      f"rounds      {out['async/exchanged_rounds']} exchanged, {out['async/skipped_rounds']} skipped, "
      f"{out['async/failed_rounds']} failed (all processes)",
      f"wall time   {fmt(out['wall_time_s'], '.1f')} s (the job's first to last logged event)",
      *[f"warning     {w}" for w in out["skipped_checkpoints"]],
      "=" * 72,
  ]
  return "\n".join(lines)


def write(workdir: str, out: dict[str, Any]) -> str:
  """WORKDIR/summary.json: the job's summary without its text (report.py reads it)."""
  path = os.path.join(workdir, "summary.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump({k: v for k, v in out.items() if k != "text"}, f, indent=2)
  return path


def at_job_end(workdir: str) -> None:
  """Prints and writes the job's result; called by the process hosting the coordination service once every
  other process has finished or been lost (main.py). A failure here is one warning with the command that
  computes it again: the job itself has ended well, its processes' runs are saved."""
  try:
    out = compute(workdir)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("The asynchronous job's result (its spread and consensus model) was not computed: %s: %s. "
                    "Compute it with: python -m noloco_jax.asynchronous.result %s", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "", workdir)
    return
  write(workdir, out)
  print(out["text"], flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m noloco_jax.asynchronous.result", description=__doc__.split("\n")[0])
  parser.add_argument("workdir", help="the asynchronous job's --workdir (it holds process_<i>/)")
  parser.add_argument("--no-eval", dest="evaluate", action="store_false",
                      help="skip the consensus model's validation loss (it builds the validation batches and compiles the model)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    out = compute(args.workdir, evaluate=args.evaluate)
  except (read_lib.CheckpointReadError, FileNotFoundError) as e:
    print(f"noloco_jax.asynchronous.result: error: {e}", file=sys.stderr)
    return 2
  print(out["text"])
  print(f"Wrote {write(args.workdir, out)} in {time.perf_counter() - start:.1f} s.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
