"""Elastic restart, measured (docs/elastic.md): a 2-process job loses process 1, the survivor resumes.

    python experiments/elastic_restart.py --out=runs/elastic [--num_steps=24 --kill_step=14 --every=6]

Runs, each with `python -m noloco_jax.main` processes started by noloco_jax/runtime/launch_local.py over
loopback (2 processes × 4 CPU devices, 8 replicas, the smoke model):

  reference   the job uninterrupted, to num_steps
  killed      the same job with NOLOCO_FAULTS=kill:process=1,step=KILL: process 1 (replicas 4-7) is
              SIGKILLed, process 0 then fails; the last checkpoint is the one before KILL
  then, each on a copy of the killed workdir, ONE process with 4 devices (the survivor) resumes with:
  same        nothing changed (8 replicas, 2 per device)
  drop        --config.num_replicas=4 --config.checkpoint.elastic=drop
  recreate    --config.checkpoint.elastic=recreate
  grow        --config.num_replicas=12 --config.checkpoint.elastic=grow

Prints one JSON object: per run its wall time, exit statuses, the eval losses by step, the last train
loss, and the elastic event (elastic.jsonl).
"""

from __future__ import annotations

import os
import shutil
import time

from experiments.lib import harness
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import launch_local

REPO = harness.REPO
RESUMES = {
    "same": [],
    "drop": ["--config.num_replicas=4", "--config.checkpoint.elastic=drop"],
    "recreate": ["--config.checkpoint.elastic=recreate"],
    "grow": ["--config.num_replicas=12", "--config.checkpoint.elastic=grow"],
}


def run(name: str, workdir: str, processes: int, flags: list[str], env: dict[str, str] | None = None) -> dict:
  start = time.time()
  job = launch_local.Job(processes, 4, flags + [f"--workdir={workdir}"], log_dir=workdir + "_logs", cwd=REPO,
                         env=env)
  codes = job.wait(timeout_s=600, grace_s=60)
  seconds = time.time() - start
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  event_path = os.path.join(workdir, "elastic.jsonl")
  train = [r for r in rows if "train/loss" in r]
  return {"run": name, "wall_s": round(seconds, 1), "exit": codes,
          "eval_loss": {r["step"]: round(r["eval/loss"], 4) for r in rows if "eval/loss" in r},
          "last_train": {"step": train[-1]["step"], "loss": round(train[-1]["train/loss"], 4)} if train else None,
          "event": metrics_lib.read_jsonl(event_path) if os.path.exists(event_path) else []}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--out", default="runs/elastic")
  bench.add_argument("--num_steps", type=int, default=24)
  bench.add_argument("--kill_step", type=int, default=14)
  bench.add_argument("--every", type=int, default=6, help="checkpoint_every and eval_every")
  opts = bench.parse(argv)
  if os.path.exists(opts.out):
    shutil.rmtree(opts.out)
  os.makedirs(opts.out)
  flags = ["--config=configs/default.py:smoke", f"--config.num_steps={opts.num_steps}",
           f"--config.checkpoint_every={opts.every}", f"--config.eval_every={opts.every}",
           "--config.checkpoint.async_save=False"]
  join = lambda name: os.path.join(opts.out, name)  # noqa: E731
  results = [run("reference", join("reference"), 2, flags)]
  killed = join("killed")
  results.append(run("killed", killed, 2, flags, env={"NOLOCO_FAULTS": f"kill:process=1,step={opts.kill_step}",
                                                      "NOLOCO_HEARTBEAT_TIMEOUT_S": "10"}))
  for name, extra in RESUMES.items():
    shutil.copytree(killed, join(name))
    results.append(run(name, join(name), 1, flags + extra))
  return bench.finish({"num_steps": opts.num_steps, "kill_step": opts.kill_step, "runs": results})


if __name__ == "__main__":
  harness.run(main)
