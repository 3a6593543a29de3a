"""A dead process ends its peers within seconds, each with the documented line (issue 18 item 14).

Before peer_watch.py the survivor was aborted by the JAX runtime once the dead process had missed
heartbeats: a C++ stack dump, `Fatal Python error: Aborted`, status -6, and no `Process i of P failed`.
"""

import os
import signal
import time

import mp_env
from test_multiprocess import PEER_DEATH_BOUND_S, _logs, _start


def _watching(log_path) -> bool:
  with open(log_path) as f:
    return "Peer watch: process" in f.read()


def test_a_killed_process_ends_the_other_with_one_line(tmp_path):
  # Process 1 dies. (When process 0 dies, the coordination service it hosts dies with it and the
  # runtime in the survivor may abort it first, just as fast: a race peer_watch.py documents.)
  victim = 1
  workdir = tmp_path / "run"
  # Killed as soon as both processes watch each other (start-up, before or during compilation).
  job = _start(workdir, tmp_path / "logs", num_steps=100_000, checkpoint_every=3)
  survivor = job.procs[1 - victim]
  try:
    deadline = time.time() + mp_env.JOB_TIMEOUT_S
    while not all(_watching(path) for path in job.log_paths) and not (
        (workdir / "checkpoints").is_dir() and os.listdir(workdir / "checkpoints")):  # (old code: training)
      assert time.time() < deadline and all(p.poll() is None for p in job.procs), _logs(job)
      time.sleep(0.2)
    job.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    code = survivor.wait(timeout=PEER_DEATH_BOUND_S)
    elapsed = time.time() - killed_at
  finally:
    job.wait(timeout_s=0, grace_s=0)
  with open(job.log_paths[1 - victim]) as f:
    log = f.read()
  assert code == 1, _logs(job)
  assert f"Process {1 - victim} of 2 failed: its connection to process {victim} closed" in log, _logs(job)
  assert "Fatal Python error" not in log and "Terminating process" not in log, _logs(job)
  # Measured 0.5 s on the loaded 2-core machine. What this tells apart is the watch (about a second) from
  # the runtime's heartbeat (mp_env.py: HEARTBEAT_S); the line asserted above is the watch's own.
  assert elapsed < PEER_DEATH_BOUND_S, f"the survivor took {elapsed:.1f} s to exit\n" + _logs(job)
