"""scripts/slurm_gpu.sbatch run here with the SLURM variables faked (issue 25 item 7).

The script is run by bash as sbatch would run it, from a copy of the repository's scripts and configs,
with `srun` and `squeue` replaced by stand-ins on PATH and scripts/env.sh by a no-op (the test's own
environment has noloco_jax installed). The stand-in srun records its command line; asked to, it runs
the command as one process on this machine's fake CPU devices, the SLURM variables removed (else
jax.distributed would take it for a SLURM job of many tasks).

What a resubmission must do, and did not: the default workdir held the SLURM job id, so the job
submitted again started from scratch in a new folder.
"""

import json
import os
import shutil
import socket
import stat
import subprocess

import pytest

from noloco_jax.config import cli
from noloco_jax.runtime import workdir_lock

import mp_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SRUN = """#!/usr/bin/env bash
# Records the command (after srun's own options); with FAKE_SRUN_RUN=1 runs it as one process.
while [[ "$1" == --* ]]; do shift; done
printf '%s\\n' "$@" > "$FAKE_SRUN_ARGS"
if [ "${FAKE_SRUN_RUN:-0}" = 1 ]; then
  unset $(env | grep -o '^SLURM_[A-Z_]*')
  exec env JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 "$@"
fi
"""

_SQUEUE = """#!/usr/bin/env bash
# squeue --noheader --jobs ID --format=%T: the state of the jobs listed in $FAKE_SQUEUE_RUNNING, else nothing.
for arg in "$@"; do case "$arg" in --jobs) next=1;; *) [ "${next:-}" = 1 ] && id="$arg"; next=;; esac; done
for running in ${FAKE_SQUEUE_RUNNING:-}; do [ "$running" = "$id" ] && echo RUNNING; done
exit 0
"""


def _executable(path, text):
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def submit_dir(tmp_path):
  """A submission directory: the script, configs, a no-op env.sh; stand-ins for srun and squeue."""
  root = tmp_path / "submit"
  (root / "scripts").mkdir(parents=True)
  shutil.copy(os.path.join(REPO, "scripts", "slurm_gpu.sbatch"), root / "scripts")
  (root / "scripts" / "env.sh").write_text("# the test's environment is already set up\n")
  os.symlink(os.path.join(REPO, "configs"), root / "configs")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _executable(bin_dir / "srun", _SRUN)
  _executable(bin_dir / "squeue", _SQUEUE)
  return root


def _submit(root, job_id: str, *args, ntasks=16, **env):
  """Runs the batch script as job `job_id`: (the command srun was given, the script's output)."""
  record = root.parent / f"srun_{job_id}.args"
  environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  environ.update(PATH=f"{root.parent / 'bin'}{os.pathsep}{environ['PATH']}", SLURM_SUBMIT_DIR=str(root),
                 SLURM_JOB_ID=job_id, SLURM_JOB_NAME="noloco", SLURM_NTASKS=str(ntasks), SLURM_JOB_NUM_NODES="2",
                 FAKE_SRUN_ARGS=str(record), **env)
  # A bound on a hung script only: a job that trains (the resubmission test) compiles cold, minutes on a
  # loaded machine (tests/mp_env.py).
  proc = subprocess.run(["bash", str(root / "scripts" / "slurm_gpu.sbatch"), *args], cwd=root, env=environ,
                        capture_output=True, text=True, timeout=mp_env.JOB_TIMEOUT_S)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return record.read_text().splitlines(), proc.stdout + proc.stderr


def test_the_default_workdir_is_the_same_for_every_submission(submit_dir):
  first, _ = _submit(submit_dir, "101")
  again, _ = _submit(submit_dir, "102")
  assert "--workdir=runs/noloco" in first and first == again  # no job id in it
  assert first[:3] == ["python", "-m", "noloco_jax.main"]
  assert "--config.num_replicas=16" in first  # the default config: one replica per GPU


PAPER = "configs/paper.py:model=small,gpus=16,dp=8,pp=2,method=noloco,data=c4"


@pytest.mark.parametrize("config,ntasks,env,replicas", [
    (PAPER, 16, {}, None),  # the row's own layout: 8 replicas × 2 stages = 16 GPUs; before: forced to 16 replicas
    (PAPER, 32, {}, "16"),  # more GPUs: more replicas of 2 stages each
    (PAPER, 16, {"NUM_REPLICAS": "4"}, "4"),  # asked for
    ("configs/default.py", 8, {}, None),  # its 8 replicas on 8 GPUs: nothing to change
], ids=["paper_row_fits", "paper_row_more_gpus", "num_replicas_set", "default_8_gpus"])
def test_replicas_follow_the_config_layout_unless_num_replicas_is_set(submit_dir, config, ntasks, env, replicas):
  args, _ = _submit(submit_dir, "7", ntasks=ntasks, CONFIG=config, **env)
  given = [a.split("=", 1)[1] for a in args if a.startswith("--config.num_replicas=")]
  assert given == ([] if replicas is None else [replicas]), args


def test_replicas_for_devices():
  assert cli.replicas_for_devices(8, 1, 1, 16) == 16
  assert cli.replicas_for_devices(8, 2, 1, 16) is None
  assert cli.replicas_for_devices(16, 1, 4, 64) is None and cli.replicas_for_devices(16, 1, 4, 32) == 8
  with pytest.raises(ValueError, match="does not divide this job's 6 devices"):
    cli.replicas_for_devices(8, 4, 1, 6)


def test_a_resubmitted_job_resumes_even_after_a_hard_kill(submit_dir, tmp_path):
  """Job 101 trains 6 steps; job 102 (the same command, more steps) resumes from its checkpoint. Between
  them, job 101's lock is left as a node failure leaves it: naming another host. squeue no longer lists
  job 101, so the lock is stale and taken over (before: refused, 'delete the lock file')."""
  flags = ["--config.checkpoint_every=6", "--config.log_every=3"]
  run = dict(CONFIG="configs/default.py:smoke", FAKE_SRUN_RUN="1")
  _submit(submit_dir, "101", *flags, "--config.num_steps=6", ntasks=8, **run)
  workdir = submit_dir / "runs" / "noloco"
  assert sorted(os.listdir(workdir / "checkpoints")) == ["6"]
  with open(workdir / workdir_lock.LOCK_NAME, "w") as f:
    json.dump({"host": "gpu-node-17", "pid": 4242, "start": "1", "slurm_job": "101", "slurm_restart": "0"}, f)
  _, output = _submit(submit_dir, "102", *flags, "--config.num_steps=12", ntasks=8, **run)
  assert "resumed from step 6" in output, output[-3000:]
  assert "was left by a run that is no longer running (host gpu-node-17, pid 4242, SLURM job 101)" in output
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "6"]


def test_a_slurm_lock_is_judged_by_squeue(tmp_path, monkeypatch, submit_dir):
  monkeypatch.setenv("PATH", f"{submit_dir.parent / 'bin'}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("SLURM_JOB_ID", "900")
  other = lambda **f: workdir_lock.Holder(**{"host": "gpu-node-3", "pid": 1, "start": None, **f})
  monkeypatch.setenv("FAKE_SQUEUE_RUNNING", "555")
  assert workdir_lock.is_alive(other(slurm_job="555"))  # squeue lists it: refused
  assert not workdir_lock.is_alive(other(slurm_job="554"))  # finished: stale
  assert workdir_lock.is_alive(other())  # no SLURM job named: cannot be judged, as before
  monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this job, requeued once
  assert not workdir_lock.is_alive(other(slurm_job="900", slurm_restart="0"))  # its run before the requeue
  assert workdir_lock.is_alive(other(slurm_job="900", slurm_restart="1"))  # this very run of it: never stale
  monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no squeue: cannot tell, so refused
  assert workdir_lock.is_alive(other(slurm_job="554"))
  assert socket.gethostname() != "gpu-node-3"
