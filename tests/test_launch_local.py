"""launch_local passes SIGTERM, SIGINT and SIGHUP on to its processes and exits only after them
(issue 18 item 5: killing the launcher used to leave its children training, unattended)."""

import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_reaches_its_processes_before_it_exits(tmp_path, sig):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
  launcher = subprocess.Popen(
      [sys.executable, "-m", "noloco_jax.runtime.launch_local", "--num_processes=2", "--module=launch_signal_child",
       "--", str(tmp_path)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ready = [tmp_path / f"child_{i}.ready" for i in range(2)]
  pids = []
  try:
    deadline = time.time() + 300  # a bound on a hung start only: Python starts slowly on a loaded machine
    while not all(r.exists() and r.read_text() for r in ready):
      assert time.time() < deadline and launcher.poll() is None, launcher.communicate(timeout=5)[0]
      time.sleep(0.05)
    pids = [int(r.read_text()) for r in ready]
    launcher.send_signal(sig)
    output = launcher.communicate(timeout=300)[0]
    # When the launcher is gone, so are its processes, and each of them received the signal.
    assert [_alive(pid) for pid in pids] == [False, False], f"children outlived the launcher:\n{output}"
    for i in range(2):
      signals = tmp_path / f"child_{i}.signals"
      assert signals.exists() and signals.read_text().split() == [sig.name], output
    assert launcher.returncode == 0, output  # the children saved and exited 0
    assert output.splitlines()[-1] == f"launch_local: stopped by {sig.name} (passed on to every process); exit statuses [0, 0]", output
  finally:
    if launcher.poll() is None:
      launcher.kill()
    for pid in pids:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_process_killed_by_a_signal_is_named_and_exits_128_plus_n(tmp_path):
  """Issue 25 item 6: a child killed by SIGKILL made the launcher exit 247 (sys.exit(-9)), with `exit statuses
  [0, -9]` as the only word of it."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.runtime.launch_local", "--num_processes=2",
                         "--module=launch_exit_child", "--grace_s=5", "--", "0", "kill"], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 137, proc.stdout + proc.stderr
  assert "launch_local: exit statuses [0, 137]: process 1 was killed by signal 9 (SIGKILL)" in proc.stdout, proc.stdout


def test_the_exit_status_is_the_process_that_failed_first(tmp_path):
  """A real job: process 1 SIGKILLed, process 0 then exits 1 because its peer died. The launcher exited 1 (the
  first non-zero status in process order), hiding the SIGKILL (e.g. the OOM killer) that started it. Process 1
  kills itself only once process 0 handles SIGTERM (LAUNCH_EXIT_CHILD_DIR): at load 10 the launcher's SIGTERM
  once reached process 0 still starting Python, which died of it ('process 0 was killed by signal 15')."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
         "LAUNCH_EXIT_CHILD_DIR": str(tmp_path)}
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.runtime.launch_local", "--num_processes=2",
                         "--module=launch_exit_child", "--grace_s=0", "--", "after:1", "kill"], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 137, proc.stdout + proc.stderr
  assert ("launch_local: exit statuses [1, 137]: process 1 failed first; process 1 was killed by signal 9 (SIGKILL)"
          in proc.stdout), proc.stdout


def test_keep_going_lets_the_others_run_after_a_failure(tmp_path):
  """--keep_going (the asynchronous schedule's processes train on without a failed one): process 1 is
  SIGKILLed, process 0 outlives it by 2 s after the launcher has reaped it and exits 0 on its own; without
  --keep_going the launcher would stop it (SIGTERM, status 143). The exit status is still the failure's."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
         "LAUNCH_EXIT_CHILD_DIR": str(tmp_path)}
  proc = subprocess.run([sys.executable, "-m", "noloco_jax.runtime.launch_local", "--num_processes=2",
                         "--module=launch_exit_child", "--grace_s=0", "--keep_going", "--", "outlive", "kill"],
                        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 137, proc.stdout + proc.stderr
  assert proc.stdout.splitlines()[-1] == "launch_local: exit statuses [0, 137]: process 1 was killed by signal 9 (SIGKILL)", proc.stdout
