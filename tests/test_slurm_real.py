"""scripts/slurm_gpu.sbatch run by a real SLURM (issue 35): the real-component tier (`bash scripts/test_real.sh`).

A one-node cluster (SLURM 22.05 from Debian: slurmctld, slurmd, munge) is started for this module by
scripts/slurm_local.sh and stopped after it. Every job is the repository's own batch script submitted
with `sbatch` as docs/slurm.md writes it for CPU nodes: the request on the command line (one node, a task
per CPU device, no GPUs) and the devices from the environment (CPU jax, one fake CPU device per task).
Every line of the script runs as it runs for a GPU user; SLURM itself starts the tasks (srun), gives
them their ids and coordinator, sends the time limit's SIGTERM, cancels, requeues and ends jobs, and
`squeue` judges a dead run's lock. What a test cannot make happen on its own clock is slowed with
NOLOCO_FAULTS (a stall or a delay after a step: timing only, no number changes) or killed with it
(SIGKILL of one task, standing in for a lost node).

Each job trains the smoke config. The 2-task job run without interruption gives the metrics of the same
config trained in one process (to rtol 1e-5, as tests/test_multiprocess.py); every interrupted run,
carried to the end by resubmitting, gives that job's metrics bit for bit. A job costs 20-90 s here, most
of it starting JAX in each task (the jobs share one compilation cache).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import workdir_lock

import mp_env

pytestmark = pytest.mark.real

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_LOCAL = os.path.join(REPO, "scripts", "slurm_local.sh")
# The CPU variant of the GPU script (docs/slurm.md): the environment and the request, nothing else.
CPU_ENV = {"NOLOCO_JAX": "", "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
CPU_REQUEST = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
CONFIG = "configs/default.py:smoke"  # 12 steps, H = 3, an evaluation (and the SIGTERM agreement) every 6
# Synchronous checkpoints every 3 steps: a step is on disk once the run has passed it.
FLAGS = ["--config.checkpoint_every=3", "--config.checkpoint.async_save=False"]
FINAL_STEP = 12


class Cluster:
  """The running one-node cluster: its directory and the environment its commands need."""

  def __init__(self, directory: str):
    self.dir = directory
    self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    self.env.update(SLURM_CONF=os.path.join(directory, "slurm.conf"), PATH=f"{os.environ['PATH']}:/usr/sbin")

  def run(self, *command: str, timeout: float = 60) -> str:
    proc = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stdout}{proc.stderr}"
    return proc.stdout

  def job(self, job_id: str) -> dict[str, str]:
    """scontrol's fields of a job (kept MinJobAge = 300 s after it ends)."""
    text = self.run("scontrol", "show", "job", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", text))

  def queued(self, job_id: str) -> bool:
    """Whether squeue still lists the job (pending, running, completing: its processes may still run)."""
    proc = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T"], env=self.env,
                          capture_output=True, text=True, timeout=60)
    return bool(proc.stdout.strip())


@pytest.fixture(scope="module")
def cluster():
  if os.geteuid() != 0:
    pytest.skip("the SLURM tests need root: scripts/slurm_local.sh installs and starts munged, slurmctld and slurmd")
  # Installing the packages takes about a minute; starting the daemons seconds.
  proc = subprocess.run(["bash", SLURM_LOCAL, "up"], capture_output=True, text=True, timeout=900)
  if proc.returncode == 3:
    pytest.skip(proc.stderr.strip().splitlines()[-1])
  assert proc.returncode == 0, f"scripts/slurm_local.sh up failed:\n{proc.stderr[-3000:]}"
  directory = proc.stdout.strip().splitlines()[-1]
  try:
    yield Cluster(directory)
  finally:
    subprocess.run(["bash", SLURM_LOCAL, "down", directory], timeout=300, check=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One persistent compilation cache for every job and the one-process run (a hit only saves time)."""
  return str(tmp_path_factory.mktemp("compile_cache"))


class Submission:
  """One sbatch command (the request, the environment, the script's arguments) that can be submitted again:
  a resubmission is the same command, so it trains in the same workdir (runs/<job name>)."""

  def __init__(self, cluster: Cluster, name: str, log_dir, cache: str, *, request=(), env=None, args=()):
    self.cluster, self.log_dir = cluster, str(log_dir)
    self.name = f"slurm-test-{name}-{os.getpid()}"
    self.workdir = os.path.join(REPO, "runs", self.name)  # the script's default: runs/<job name>
    self.command = ["sbatch", "--parsable", f"--job-name={self.name}", f"--output={self.log_dir}/%j.out",
                    *CPU_REQUEST, *request, "scripts/slurm_gpu.sbatch", *FLAGS, *args]
    self.env = {**cluster.env, **CPU_ENV, **mp_env.env(), "CONFIG": CONFIG, "NOLOCO_EXTRAS": "test",
                "NOLOCO_COMPILE_CACHE": cache, **(env or {})}
    self.env.pop("WORKDIR", None)
    shutil.rmtree(self.workdir, ignore_errors=True)

  def submit(self) -> str:
    proc = subprocess.run(self.command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]

  def log(self, job_id: str) -> str:
    path = os.path.join(self.log_dir, f"{job_id}.out")
    return open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else ""

  def tail(self, job_id: str) -> str:
    return f"job {job_id}, {self.log_dir}/{job_id}.out ends:\n" + "\n".join(self.log(job_id).splitlines()[-40:])

  def wait(self, job_id: str, timeout_s: float = mp_env.JOB_TIMEOUT_S) -> dict[str, str]:
    """Waits for the job to end (a bound on a hung job only, which is then cancelled), returns scontrol's fields."""
    def cancel_and_tail():
      subprocess.run(["scancel", job_id], env=self.cluster.env, check=False, timeout=60)
      return self.tail(job_id)

    _wait_for(lambda: not self.cluster.queued(job_id), timeout_s, f"job {job_id} to end", cancel_and_tail)
    return self.cluster.job(job_id)

  def checkpoints(self) -> list[int]:
    path = os.path.join(self.workdir, "checkpoints")
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []

  def wait_for_checkpoint(self, job_id: str, step: int) -> None:
    _wait_for(lambda: step in self.checkpoints() or not self.cluster.queued(job_id), mp_env.JOB_TIMEOUT_S,
              f"job {job_id} to save step {step}", lambda: self.tail(job_id))
    assert step in self.checkpoints(), self.tail(job_id)

  def cleanup(self) -> None:
    shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_for(condition, timeout_s: float, what: str, on_timeout=lambda: "") -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      pytest.fail(f"waited {timeout_s:.0f} s for {what}\n{on_timeout()}")
    time.sleep(0.5)


@pytest.fixture
def submission(cluster, cache, tmp_path, request):
  made = []

  def make(**kwargs) -> Submission:
    made.append(Submission(cluster, request.node.name.replace("_", "-")[5:40], tmp_path, cache, **kwargs))
    return made[-1]

  yield make
  for s in made:
    s.cleanup()


def _rows(workdir: str) -> list[dict]:
  """metrics.jsonl without perf/* (timings) and without the weight std of training rows (a multi-process
  job logs it at evaluations only: tests/test_multiprocess.py)."""
  keep = lambda row, key: not key.startswith("perf/") and not (key == "replicas/weight_std" and "train/loss" in row)
  return [{k: v for k, v in row.items() if keep(row, k)}
          for row in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache):
  """The same config trained in one process on 2 CPU devices (2 replicas, as the 2-task job): its rows."""
  workdir = str(tmp_path_factory.mktemp("one_process") / "run")
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  env.update(CPU_ENV, JAX_NUM_CPU_DEVICES="2", NOLOCO_COMPILE_CACHE=cache)
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.main", f"--config={CONFIG}", f"--workdir={workdir}",
                         "--config.num_replicas=2", *FLAGS], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=mp_env.JOB_TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return _rows(workdir)


@pytest.fixture(scope="module")
def uninterrupted(cluster, cache, tmp_path_factory):
  """The 2-task job run once to the end: (its submission, job id, scontrol's fields, its rows)."""
  s = Submission(cluster, "uninterrupted", tmp_path_factory.mktemp("uninterrupted"), cache)
  job_id = s.submit()
  job = s.wait(job_id)
  try:
    yield s, job_id, job, _rows(s.workdir) if os.path.exists(os.path.join(s.workdir, "metrics.jsonl")) else []
  finally:
    s.cleanup()


def _assert_same_run(s: Submission, uninterrupted, job_id: str) -> None:
  """The interrupted run, carried to the end, equals the uninterrupted job bit for bit (the same 2 tasks)."""
  assert FINAL_STEP in s.checkpoints(), s.tail(job_id)
  rows = uninterrupted[3]
  assert rows and rows[-1]["step"] == FINAL_STEP, uninterrupted[0].tail(uninterrupted[1])
  assert _rows(s.workdir) == rows, s.tail(job_id)


def _stopped(log: str) -> int:
  """The step a SIGTERM stopped the run at (its 'Stop requested' line)."""
  found = re.findall(r"Stop requested: saved a checkpoint at step (\d+)", log)
  assert found, log[-3000:]
  return int(found[-1])


def _resumed(log: str) -> int:
  found = re.findall(r"resumed from step (\d+)", log)
  assert found, log[-3000:]
  return int(found[-1])


def test_a_two_task_job_trains_as_one_process_does(uninterrupted, one_process):
  """Every metric equals the one-process run's to rtol 1e-5, as in tests/test_multiprocess.py: the weights
  move the same way, but a 2-process job averages its replicas' training metrics on the host (float64)
  where one process averages them on the device (float32), so the means differ in the last bits."""
  s, job_id, job, rows = uninterrupted
  log = s.log(job_id)
  assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), s.tail(job_id)
  # jax.distributed took the process count, ids and coordinator from SLURM itself.
  assert "SlurmCluster detected with 2 processes" in log and "Process 1 of 2" in log, s.tail(job_id)
  assert f"replicas: 2, lockstep schedule, workdir runs/{s.name}" in log
  assert [r["step"] for r in rows] == [r["step"] for r in one_process]
  for got, want in zip(rows, one_process):
    assert got.keys() == want.keys(), (got, want)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"step {want['step']} {key}")


def test_the_time_limit_signal_saves_and_the_same_command_resumes(submission, uninterrupted, cluster):
  """--time=3 with the script's own --signal=TERM@120: SLURM sent SIGTERM 30-60 s after the start (it
  checks time limits about every 30 s and signals up to 30 s before the 120 s asked). The stall after
  step 3 keeps the first run going past that window; a resumed run starts after step 3 and never stalls."""
  s = submission(request=["--time=3"], env={"NOLOCO_FAULTS": "stall:step=3,seconds=50"})
  first = s.submit()
  job = s.wait(first)
  log = s.log(first)
  assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), s.tail(first)  # every task exited 0
  stopped = _stopped(log)
  assert stopped < FINAL_STEP and s.checkpoints()[-1] == stopped, s.tail(first)
  for _ in range(3):  # the same command until the run is done (a resumed run may be signalled again)
    again = s.submit()
    job = s.wait(again)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), s.tail(again)
    assert _resumed(s.log(again)) == stopped, s.tail(again)
    if FINAL_STEP in s.checkpoints():
      break
    stopped = _stopped(s.log(again))
  _assert_same_run(s, uninterrupted, again)


def test_scancel_then_the_same_command_resumes_from_the_last_checkpoint(submission, uninterrupted, cluster):
  """scancel sends SIGTERM (then SIGKILL after KillWait, 30 s): the run stops at its next agreement step,
  saves, and the resubmission resumes there. A delay after each step leaves time to cancel mid-run."""
  s = submission(env={"NOLOCO_FAULTS": "delay:seconds=2"})
  first = s.submit()
  s.wait_for_checkpoint(first, 3)
  cluster.run("scancel", first)
  job = s.wait(first)
  assert job["JobState"] == "CANCELLED", s.tail(first)
  last = s.checkpoints()[-1]
  assert last == _stopped(s.log(first)) < FINAL_STEP, s.tail(first)
  s.env.pop("NOLOCO_FAULTS")  # the delay was only there to cancel mid-run
  again = s.submit()
  job = s.wait(again)
  assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), s.tail(again)
  assert _resumed(s.log(again)) == last
  _assert_same_run(s, uninterrupted, again)


def test_a_requeued_job_resumes_from_the_last_checkpoint(submission, uninterrupted, cluster):
  """scontrol requeue: the running job is stopped as by scancel and queued again under the same id
  (SLURM_RESTART_COUNT=1); SLURM holds a requeued job back for about two minutes, which the test lifts."""
  s = submission(request=["--open-mode=append"], env={"NOLOCO_FAULTS": "delay:seconds=2"})
  job_id = s.submit()
  s.wait_for_checkpoint(job_id, 3)
  cluster.run("scontrol", "requeue", job_id)
  _wait_for(lambda: cluster.job(job_id)["JobState"] == "PENDING", 300, f"job {job_id} to be queued again",
            lambda: s.tail(job_id))
  stopped = _stopped(s.log(job_id))
  assert s.checkpoints()[-1] == stopped < FINAL_STEP, s.tail(job_id)
  cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
  job = s.wait(job_id)
  assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), s.tail(job_id)
  assert _resumed(s.log(job_id)) == stopped
  _assert_same_run(s, uninterrupted, job_id)


def _processes_of(job_id: str) -> list[int]:
  """Pids on this machine whose environment names the SLURM job."""
  found, mark = [], f"SLURM_JOB_ID={job_id}\0".encode()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if mark in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def test_a_killed_task_ends_the_job_and_the_next_submission_takes_over_its_lock(submission, uninterrupted, cluster):
  """Task 0 SIGKILLed after step 4 (its lock is left behind): the job ends FAILED with no task left (the
  other one is ended by its peer watch or by SLURM, whichever comes first). On a cluster the resubmission
  usually lands on another node, where the dead run's pid means nothing: its lock is rewritten to name
  another host, so that only the real squeue can judge it."""
  s = submission(env={"NOLOCO_FAULTS": "kill:process=0,step=4"})
  first = s.submit()
  job = s.wait(first)
  log = s.log(first)
  assert (job["JobState"], job["ExitCode"]) == ("FAILED", "137:0"), s.tail(first)
  assert "task 0: Killed" in log, s.tail(first)
  assert _processes_of(first) == []  # every task stopped
  assert s.checkpoints() == [3]
  lock_path = os.path.join(s.workdir, workdir_lock.LOCK_NAME)
  with open(lock_path) as f:
    lock = json.load(f)
  assert lock["slurm_job"] == first
  lock["host"] = "lost-node-7"
  with open(lock_path, "w") as f:
    json.dump(lock, f)
  s.env.pop("NOLOCO_FAULTS")
  again = s.submit()
  job = s.wait(again)
  log = s.log(again)
  assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), s.tail(again)
  assert (f"was left by a run that is no longer running (host lost-node-7, pid {lock['pid']}, SLURM job {first}"
          in log), s.tail(again)
  assert _resumed(log) == 3
  _assert_same_run(s, uninterrupted, again)


def test_a_lock_naming_a_running_job_on_another_host_is_refused_until_squeue_drops_it(cluster, monkeypatch):
  for name in ("SLURM_CONF", "PATH"):  # for the squeue that workdir_lock runs
    monkeypatch.setenv(name, cluster.env[name])
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  job_id = cluster.run("sbatch", "--parsable", "--ntasks=1", "--output=/dev/null", "--wrap=sleep 300").strip()
  try:
    _wait_for(lambda: cluster.job(job_id)["JobState"] == "RUNNING", 60, f"job {job_id} to start")
    holder = workdir_lock.Holder(host="lost-node-7", pid=1, start=None, slurm_job=job_id, slurm_restart="0")
    assert workdir_lock.is_alive(holder)
  finally:
    cluster.run("scancel", job_id)
  _wait_for(lambda: not cluster.queued(job_id), 60, f"job {job_id} to end")
  assert not workdir_lock.is_alive(holder)


def test_the_asynchronous_schedule_trains_on_when_one_task_dies(submission, cluster):
  """Three tasks, task 2 SIGKILLed after step 3: SLURM leaves the others running (the script passes
  --kill-on-bad-exit=0 for this schedule; before, SLURM ended them with it); they see it lost (its lease,
  3 s, runs out) and train to the end without it, pairing in the rounds after that only with each other."""
  s = submission(request=["--ntasks-per-node=3"], args=["--config.outer.schedule=async", "--config.outer.asynchronous.lease_s=3"],
                 # The service's host (task 0) waits for a silent process up to the runtime's heartbeat timeout
                 # before it exits (issue 33 item 2): the tests' 1200 s would outlast the job's bound, so 60 s
                 # here (task 2 is dead; a live task beats every few seconds).
                 env={"NOLOCO_FAULTS": "delay:seconds=1;kill:process=2,step=3", "NOLOCO_HEARTBEAT_TIMEOUT_S": "60"})
  job_id = s.submit()
  job = s.wait(job_id)
  log = s.log(job_id)
  assert "replicas: 3, async schedule" in log, s.tail(job_id)
  # The job's status is the killed task's (srun's): the survivors' work is in their own directories.
  assert (job["JobState"], job["ExitCode"]) == ("FAILED", "137:0") and "task 2: Killed" in log, s.tail(job_id)
  assert "This process uses only the accelerator(s) 2 of its node" in log  # the GPU of its SLURM_LOCALID
  for slot in (0, 1):
    process = os.path.join(s.workdir, f"process_{slot}")
    assert FINAL_STEP in [int(d) for d in os.listdir(os.path.join(process, "checkpoints")) if d.isdigit()]
    events = metrics_lib.read_jsonl(os.path.join(process, f"membership_{slot}.jsonl"))
    lost = [e["time"] for e in events if e.get("slot") == 2 and e.get("event") == "lost"]
    assert lost, events
    rounds = metrics_lib.read_jsonl(os.path.join(process, f"pairings_{slot}.jsonl"))
    after = [r for r in rounds if r["time"] > lost[0]]
    assert after and all(2 not in (r.get("group") or []) for r in after), rounds  # trained on, never with it
  assert not os.path.isdir(os.path.join(s.workdir, "process_2", "checkpoints", str(FINAL_STEP)))
