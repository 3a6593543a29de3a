"""Start-up checks of multi-process jobs (issue 18 items 4 and 15): a shared workdir, named config fields.

The 2-process jobs are real subprocesses over loopback, started like test_multiprocess.py's
mismatched-process test, with its tiny smoke config.
"""

import os
import subprocess
import sys
import time

from configs import default
from noloco_jax.runtime import job_checks
from noloco_jax.runtime import launch_local
import mp_env
from test_multiprocess import REPO, _flags


def _start_pair(root, per_process_flags):
  """Two processes of one job; per_process_flags[i] = (workdir, {override: value}) of process i."""
  port = launch_local.free_port()
  procs = []
  for pid, (workdir, extra) in enumerate(per_process_flags):
    env = launch_local.process_env(pid, 2, 4, port, mp_env.env())
    with open(root / f"p{pid}.log", "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "noloco_jax.main"] + _flags(workdir, **extra),
                                    env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
  return procs


def _logs(root):
  return "".join(f"==== p{i}.log\n" + open(root / f"p{i}.log").read()[-6000:] for i in range(2))


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def test_processes_with_different_workdirs_refuse_at_start_up(tmp_path):
  """Before the check, this job trained and then hung at its first save (step 6) for good."""
  run0, run1 = tmp_path / "run0", tmp_path / "run1"
  procs = _start_pair(tmp_path, [(run0, {}), (run1, {})])
  deadline = time.time() + mp_env.JOB_TIMEOUT_S
  try:
    while any(p.poll() is None for p in procs):
      trained = [d for d in (run0, run1) if (d / "checkpoints").is_dir() and os.listdir(d / "checkpoints")]
      assert not trained, f"the job trained up to a save in {trained} instead of refusing:\n" + _logs(tmp_path)
      assert time.time() < deadline, f"the job neither refused nor finished in {mp_env.JOB_TIMEOUT_S} s:\n" + _logs(tmp_path)
      time.sleep(0.2)
  finally:
    _kill(procs)
  logs = _logs(tmp_path)
  assert all(p.returncode == 1 for p in procs), logs
  assert "workdir is not one shared directory" in logs and "processes [1] do not see" in logs, logs
  assert f"process 1 on" in logs and str(run1) in logs, logs
  # The check leaves nothing behind.
  assert not [f for f in os.listdir(run0) if f.startswith(job_checks.MARKER_PREFIX)]


def test_a_config_mismatch_between_processes_names_the_fields(tmp_path):
  procs = _start_pair(tmp_path, [(tmp_path / "run", {}), (tmp_path / "run", {"inner.lr": 0.001})])
  try:
    codes = [p.wait(timeout=mp_env.JOB_TIMEOUT_S) for p in procs]
  finally:
    _kill(procs)
  logs = _logs(tmp_path)
  assert codes == [1, 1], logs
  assert "config differs in inner.lr: processes [0] have 0.003; processes [1] have 0.001" in logs, logs


def test_config_differences_name_each_field_and_its_values():
  a = job_checks.flatten_config(default.get_config("smoke"))
  b = dict(a, **{"inner.lr": "0.001", "outer.kind": '"diloco"'})
  c = {k: v for k, v in a.items() if k != "seed"}
  assert a["data.seq_len"] == "32" and a["outer.kind"] == '"noloco"'
  assert job_checks.config_differences([a, a]) == []
  assert job_checks.config_differences([a, b, a, c]) == [
      "inner.lr: processes [0, 2, 3] have 0.003; processes [1] have 0.001",
      'outer.kind: processes [0, 2, 3] have "noloco"; processes [1] have "diloco"',
      "seed: processes [0, 1, 2] have 0; processes [3] have (absent)",
  ]
