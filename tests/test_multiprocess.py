"""Multi-process jobs over loopback: 2 processes × 4 fake CPU devices against 1 process × 8 devices.

The 2-process jobs run as real subprocesses (noloco_jax.runtime.launch_local, gloo collectives over
127.0.0.1); the 1-process runs are in this pytest process, whose 8 fake devices come from conftest.py.

Tolerance: every metric of the 2-process job equals the 1-process one to rtol 1e-5. Observed: all
values are bitwise equal except `replicas/weight_std`, whose cross-replica all-reduce sums in another
order across processes (≈ 6e-8 relative). The NoLoCo state itself only moves through ppermute, so
the weights are bitwise equal.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax.runtime import distributed
from noloco_jax.runtime import options as options_lib
from noloco_jax.runtime import launch_local
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax import training

import mp_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5
# Overrides on top of `smoke`: checkpoints after steps 6 and 12, synchronous so the test can rely on
# a step being on disk as soon as the run passes it.
OVERRIDES = {"checkpoint_every": 6, "checkpoint.async_save": False}
# A survivor's bound after its peer is killed: far above peer_watch.py's second, far below the heartbeat.
PEER_DEATH_BOUND_S = mp_env.HEARTBEAT_S // 4


def _config(**extra):
  config = default.get_config("smoke")
  for key, value in {**OVERRIDES, **extra}.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


def _flags(workdir, **extra):
  return ["--config=configs/default.py:smoke", f"--workdir={workdir}"] + [
      f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]


def _start(workdir, log_dir, num_processes=2, devices=4, **extra):
  return launch_local.Job(num_processes, devices, _flags(workdir, **extra), log_dir=str(log_dir), cwd=REPO,
                          env=mp_env.env())


def _logs(job) -> str:
  out = []
  for path in job.log_paths:
    with open(path) as f:
      out.append(f"==== {path}\n" + "".join(f.readlines()[-40:]))
  return "\n".join(out)


def _rows(workdir):
  """metrics.jsonl without perf/* (timings), and without the weight std of training rows: a
  multi-process job logs it at evaluations only (log_barrier=False: it is an all-reduce over every
  replica; see io/process_metrics.py), a one-process job also after every round."""
  def keep(row, key):
    return not key.startswith("perf/") and not (key == "replicas/weight_std" and "train/loss" in row)
  return [{k: v for k, v in row.items() if keep(row, k)}
          for row in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _assert_same_metrics(got, want):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    assert g.keys() == w.keys(), (g, w)
    for key in w:
      np.testing.assert_allclose(g[key], w[key], rtol=RTOL, err_msg=f"step {w['step']} {key}")


def _leave_rows_of_a_dead_run(workdir) -> None:
  """What a 2-process job killed at step 7, before its first checkpoint completed, leaves behind."""
  os.makedirs(workdir / "metrics")
  for p in (0, 1):
    with open(workdir / "metrics" / f"process_{p}.jsonl", "w") as f:
      for step in (3, 6):
        f.write(json.dumps({"step": step, "train/loss": 99.0, "train/grad_norm": 1.0, "comm/bytes_per_replica": 0,
                            "outer/round": step // 3, "perf/steps_per_s": 1.0, "perf/tokens_per_s": 512.0,
                            "outer/pseudo_grad_norm": 1.0, "replicas/local": 4, "time": 0.0}) + "\n")
  with open(workdir / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 3, "train/loss": 99.0}) + "\n" + json.dumps({"step": 6, "train/loss": 99.0}) + "\n")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  """The 2 × 4 job, run once: (workdir, job). Its workdir starts with the rows of a 2-process run killed
  before its first checkpoint (issue 25 item 1: they were merged again, and every row after them lost)."""
  root = tmp_path_factory.mktemp("mp2")
  workdir = root / "run"
  _leave_rows_of_a_dead_run(workdir)
  job = _start(workdir, root / "logs")
  codes = job.wait(timeout_s=mp_env.JOB_TIMEOUT_S, grace_s=30)
  assert codes == [0, 0], _logs(job)
  return str(workdir), job


def test_two_processes_match_one_process_and_resume_in_one(two_process_run, tmp_path):
  workdir2, job = two_process_run
  with open(job.log_paths[0]) as f:
    log0 = f.read()
  assert "process 1: devices" in log0 and "2 processes agree" in log0  # the layout and the start-up check
  assert not os.path.exists(os.path.join(workdir2, "process_1")), "only process 0 writes metrics.jsonl"
  for p in (0, 1):  # each process's own training rows, which process 0 merged into metrics.jsonl
    rows = metrics_lib.read_jsonl(os.path.join(workdir2, "metrics", f"process_{p}.jsonl"))
    assert [r["step"] for r in rows] == [3, 6, 9, 12] and {r["replicas/local"] for r in rows} == {4}

  # The end-of-run summary reports the job's training loss, as metrics.jsonl does, not process 0's
  # replicas' own (which each process knows alone: log_barrier=False).
  summary = json.load(open(os.path.join(workdir2, "summary.json")))
  last_train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir2, "metrics.jsonl")) if "train/loss" in r][-1]
  process0 = metrics_lib.read_jsonl(os.path.join(workdir2, "metrics", "process_0.jsonl"))[-1]["train/loss"]
  assert summary["train/loss"] == last_train["train/loss"] != process0
  assert summary["train/loss_over"] == "all replicas (metrics.jsonl)" and summary["resumed_from_step"] == 0
  assert f"train/loss  {last_train['train/loss']:.4f}" in log0 and f"workdir     {workdir2} (started from scratch)" in log0

  one = training.train_and_evaluate(_config(), str(tmp_path / "one"))
  _assert_same_metrics(_rows(workdir2), _rows(tmp_path / "one"))

  # The 2-process checkpoint of step 6 resumes in one process and ends where the 1-process run ended.
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(workdir2, resumed_dir)
  shutil.rmtree(resumed_dir / "checkpoints" / "12")
  resumed = training.train_and_evaluate(_config(), str(resumed_dir))
  _assert_same_metrics(_rows(resumed_dir), _rows(tmp_path / "one"))
  assert resumed["resumed_from_step"] == 6 and "resumed from its checkpoint at step 6" in resumed["text"]
  for a, b in zip(_host_leaves(resumed["state"].params), _host_leaves(one["state"].params)):
    np.testing.assert_array_equal(a, b)  # NoLoCo moves values only by ppermute: bitwise equal


def _host_leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(mesh_lib.fetch(tree))]


def test_a_killed_process_ends_the_job_quickly_and_the_checkpoint_stays_valid(tmp_path):
  workdir = tmp_path / "run"
  job = _start(workdir, tmp_path / "logs", num_steps=100_000, checkpoint_every=3)
  ckpt_dir = workdir / "checkpoints"
  deadline = time.time() + mp_env.JOB_TIMEOUT_S
  while not (ckpt_dir.is_dir() and len([d for d in os.listdir(ckpt_dir) if d.isdigit()]) >= 2):
    assert time.time() < deadline and all(p.poll() is None for p in job.procs), _logs(job)
    time.sleep(0.5)
  job.procs[1].send_signal(signal.SIGKILL)
  killed_at = time.time()
  try:
    rc0 = job.procs[0].wait(timeout=PEER_DEATH_BOUND_S)
  except Exception:  # pylint: disable=broad-except
    job.wait(timeout_s=0, grace_s=0)
    raise AssertionError(f"process 0 did not exit within {PEER_DEATH_BOUND_S} s of its peer's death:\n" + _logs(job))
  elapsed = time.time() - killed_at
  job.wait(timeout_s=0, grace_s=5)
  assert rc0 != 0, _logs(job)
  # peer_watch.py (or the broken link failing process 0's next collective) ends process 0 within about
  # a second; what the bound tells apart is that from the runtime's heartbeat (mp_env.py), which alone
  # would take HEARTBEAT_S. A quarter of it leaves a starved machine all the room it needs.
  assert elapsed < PEER_DEATH_BOUND_S, f"process 0 took {elapsed:.1f} s to exit\n" + _logs(job)
  with open(job.log_paths[0]) as f:
    log0 = f.read()
  assert "Process 0 of 2 failed" in log0 or "distributed service detected fatal errors" in log0, _logs(job)

  # Whatever was on disk at the kill restores: the latest committed step resumes in one process.
  steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  latest = steps[-1]
  result = training.train_and_evaluate(_config(num_steps=latest + 3, checkpoint_every=3), str(workdir))
  assert result["history"]["eval"][-1]["step"] == latest + 3
  assert _rows(workdir)[-1]["step"] == latest + 3


def test_mismatched_processes_fail_the_start_up_check(tmp_path):
  """Process 1 runs another seed: both processes stop with an error naming the differing fields."""
  root = tmp_path
  port = launch_local.free_port()
  procs = []
  for pid, seed in ((0, 0), (1, 1)):
    env = launch_local.process_env(pid, 2, 4, port, mp_env.env())
    with open(root / f"p{pid}.log", "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "noloco_jax.main"] + _flags(root / "run", seed=seed),
                                    env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
  codes = [p.wait(timeout=mp_env.JOB_TIMEOUT_S) for p in procs]
  logs = "".join(open(root / f"p{i}.log").read() for i in range(2))
  assert all(c != 0 for c in codes), logs
  assert "ConsistencyError" in logs and "seed differs: processes [0] have '0'; processes [1] have '1'" in logs, logs


def test_options_resolve_flags_then_environment_then_defaults():
  env = {"NOLOCO_COORDINATOR_ADDRESS": "10.0.0.1:1234", "NOLOCO_NUM_PROCESSES": "4", "NOLOCO_PROCESS_ID": "3"}
  opts = options_lib.resolve_options(env, process_id=2)
  assert (opts.coordinator_address, opts.num_processes, opts.process_id) == ("10.0.0.1:1234", 4, 2)
  assert opts.heartbeat_timeout_s == options_lib.Options.heartbeat_timeout_s
  assert distributed.plan(opts)[0]
  assert not distributed.plan(options_lib.resolve_options({}, num_processes=1))[0]
  assert not distributed.plan(options_lib.resolve_options({"NOLOCO_DISTRIBUTED": "off"}, num_processes=4))[0]
  with pytest.raises(ValueError, match="NOLOCO_NUM_PROCESSES"):
    options_lib.resolve_options({"NOLOCO_NUM_PROCESSES": "two"})


def test_a_slurm_job_with_several_tasks_is_detected(monkeypatch):
  for key, value in {"SLURM_JOB_ID": "123", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "16",
                     "SLURM_PROCID": "5", "SLURM_LOCALID": "5"}.items():
    monkeypatch.setenv(key, value)
  assert distributed.detect_cluster() == ("SlurmCluster", 16)
  assert distributed.plan(options_lib.resolve_options({})) == (True, "SlurmCluster detected with 16 processes")
  monkeypatch.setenv("SLURM_NTASKS", "1")  # a single-task step stays a single-process job
  assert not distributed.plan(options_lib.resolve_options({}))[0]


def test_replica_checksums_tell_replicas_apart():
  mesh = mesh_lib.make_mesh(8, 8)
  x = np.broadcast_to(np.random.default_rng(0).normal(size=(1, 5, 3)).astype(np.float32), (8, 5, 3)).copy()
  x[3, 4, 2] = np.nextafter(x[3, 4, 2], np.float32(np.inf))  # one ulp on one replica
  tree = {"w": jax.device_put(x, mesh_lib.replica_sharding(mesh)),
          "step": jax.device_put(jnp.zeros(8, jnp.int32), mesh_lib.replica_sharding(mesh)),
          "h": jax.device_put(jnp.ones((8, 2), jnp.bfloat16), mesh_lib.replica_sharding(mesh))}
  sums = distributed.replica_checksums(mesh, tree)
  differ = [r for r in range(8) if not np.array_equal(sums[r], sums[0])]
  assert differ == [3]


def test_start_up_problems_before_jax_distributed_are_one_line(monkeypatch, capsys):
  """Issue 25 item 6: a bad NOLOCO_NUM_PROCESSES was a traceback (exit 1); a coordinator that never answered
  made the runtime abort with a C++ stack dump (status 134)."""
  import socket  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("NOLOCO_NUM_PROCESSES", "two")
  # Every flag unset (main.py's flags, one per field of options_lib.Options; `mode` is --distributed).
  flag_values = types.SimpleNamespace(**{("distributed" if f.name == "mode" else f.name): None
                                         for f in dataclasses.fields(options_lib.Options)})
  with pytest.raises(SystemExit) as usage:
    options_lib.options_from_flags(flag_values)
  assert usage.value.code == 2
  assert capsys.readouterr().err == "noloco_jax: NOLOCO_NUM_PROCESSES='two' is not valid: an integer is needed.\n"
  port = launch_local.free_port()  # nobody listens there
  start = time.monotonic()
  with pytest.raises(SystemExit) as unreachable:
    distributed.wait_for_coordinator(f"127.0.0.1:{port}", 1.5)
  assert time.monotonic() - start >= 1.5
  assert str(unreachable.value).startswith(f"noloco_jax: error: the coordinator 127.0.0.1:{port} (process 0) did "
                                           "not answer within 1.5 s (ConnectionRefusedError")
  with socket.socket() as listening:
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    distributed.wait_for_coordinator(f"127.0.0.1:{listening.getsockname()[1]}", 5)  # answers: returns
