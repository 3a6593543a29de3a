"""scripts/slurm_gpu.sbatch's own logic, cheaply, with the SLURM variables faked (issue 25 item 7).

What a real SLURM does with the script (jobs of 2 and 3 tasks, the time limit's signal, scancel,
requeue, a killed task, a dead run's lock judged by the real squeue) is tested against a real one-node
cluster in tests/test_slurm_real.py (the real-component tier). Here, in the default suite: how many
replicas the script asks for (a config's layout against the job's GPUs), the config field the script
reads, the lock's judgement of SLURM runs (a requeue, no squeue), each process's GPU in the asynchronous
schedule, and that docs/slurm.md gives the command the real tests run.

The script is run by bash as sbatch would run it, from a copy of the repository's scripts and configs,
with `srun` and `squeue` replaced by stand-ins on PATH and scripts/env.sh by a no-op (the test's own
environment has noloco_jax installed). The stand-in srun records its command line.
"""

import os
import shutil
import socket
import stat
import subprocess
import sys

import jax
import pytest

from noloco_jax.config import cli
from noloco_jax.runtime import distributed
from noloco_jax.runtime import options as options_lib
from noloco_jax.runtime import workdir_lock

import test_slurm_real as real

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SRUN = """#!/usr/bin/env bash
# Records its command line, one argument a line.
printf '%s\\n' "$@" > "$FAKE_SRUN_ARGS"
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
  """Runs the batch script as job `job_id`: (the arguments srun was given, the script's output)."""
  record = root.parent / f"srun_{job_id}.args"
  environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  environ.update(PATH=f"{root.parent / 'bin'}{os.pathsep}{environ['PATH']}", SLURM_SUBMIT_DIR=str(root),
                 SLURM_JOB_ID=job_id, SLURM_JOB_NAME="noloco", SLURM_NTASKS=str(ntasks), SLURM_JOB_NUM_NODES="2",
                 FAKE_SRUN_ARGS=str(record), **env)
  proc = subprocess.run(["bash", str(root / "scripts" / "slurm_gpu.sbatch"), *args], cwd=root, env=environ,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return record.read_text().splitlines(), proc.stdout + proc.stderr


@pytest.mark.parametrize("args,kill_on_bad_exit", [((), "1"), (("--config.outer.schedule=async",), "0")],
                         ids=["lockstep", "async"])
def test_one_workdir_for_every_submission_and_the_schedule_decides_whether_slurm_ends_the_job(
    submit_dir, args, kill_on_bad_exit):
  first, _ = _submit(submit_dir, "101", *args)
  again, output = _submit(submit_dir, "102", *args)
  assert "--workdir=runs/noloco" in first and first == again  # no job id in it
  # Lock-step: one task's death ends the job; asynchronous: the others train on (docs/async.md).
  assert first[:2] == [f"--kill-on-bad-exit={kill_on_bad_exit}", "--cpu-bind=none"]
  assert first[2:5] == ["python", "-m", "noloco_jax.main"]
  assert "--config.num_replicas=16" in first  # the default config: one replica per GPU
  assert f"{'async' if args else 'lockstep'} schedule" in output


def test_the_config_field_the_script_reads(capsys, monkeypatch):
  def field(*argv):  # as `python -m noloco_jax.config.cli field ...` (ml_collections reads overrides in sys.argv)
    monkeypatch.setattr(sys, "argv", ["cli", "field", *argv])
    return cli._field_main(sys.argv)

  argv = ["outer.schedule", "--config=configs/default.py:smoke", "--workdir=x"]
  assert field(*argv) == 0 and capsys.readouterr().out == "lockstep\n"
  assert field(*argv, "--config.outer.schedule=async") == 0 and capsys.readouterr().out == "async\n"
  with pytest.raises(SystemExit) as usage:
    field("outer.schedul", "--config=configs/default.py")
  assert usage.value.code == 2
  assert capsys.readouterr().err == ("noloco_jax: config.outer.schedul is not a field; did you mean "
                                     "config.outer.schedule?\n")


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


def test_an_asynchronous_process_uses_only_the_gpu_of_its_local_index(monkeypatch):
  """The asynchronous schedule does not start jax.distributed, which is what restricts each process to
  the GPU of its SLURM_LOCALID; under scripts/slurm_gpu.sbatch every task sees all GPUs of its node, so
  each process of a node started JAX on all of them (before: the setting stayed as it was)."""
  for name, value in dict(SLURM_JOB_ID="7", SLURM_NTASKS="3", SLURM_PROCID="2", SLURM_LOCALID="2",
                          SLURM_STEP_NODELIST="gpu-node-1", SLURM_JOB_NODELIST="gpu-node-1").items():
    monkeypatch.setenv(name, value)
  names = ("jax_cuda_visible_devices", "jax_rocm_visible_devices")
  before = [jax.config.values[name] for name in names]
  try:
    address, count, pid = distributed.process_coordinates(options_lib.resolve_options({}))
    assert (address, count, pid) == ("gpu-node-1:61447", 3, 2)
    assert [jax.config.values[name] for name in names] == ["2", "2"]
  finally:
    for name, value in zip(names, before):
      jax.config.update(name, value)


def test_the_docs_give_the_command_the_real_tests_run():
  with open(os.path.join(REPO, "docs", "slurm.md"), encoding="utf-8") as f:
    text = " ".join(f.read().replace("\\\n", " ").split())
  env = " ".join(f"{k}={v}" for k, v in real.CPU_ENV.items())
  request = " ".join(real.CPU_REQUEST)
  assert f"{env} CONFIG={real.CONFIG} sbatch {request} scripts/slurm_gpu.sbatch" in text
  assert (f"{env} CONFIG={real.CONFIG} sbatch {request.replace('node=2', 'node=3')} scripts/slurm_gpu.sbatch "
          "--config.outer.schedule=async") in text
