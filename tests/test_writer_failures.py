"""A metric writer that fails (issue 33, 9): a side channel (TensorBoard, W&B) is turned off with one
warning and the run goes on; metrics.jsonl, the record a resume rewrites, stops the run in one line.

On fake writers, then through the command line on the smoke job (the failure injected into the writer,
or, for W&B, its service process killed mid-run).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from noloco_jax.io import writers
from test_checkpoint import REPO, START_TIMEOUT_S, cache, stderr_of  # noqa: F401

SMOKE = ["--config=configs/default.py:smoke", "--config.num_steps=12", "--config.checkpoint_every=6"]


class _Fake(writers.MetricWriter):
  keeps_record = True

  def __init__(self, name, fail_at=None):
    self.name, self.fail_at, self.rows, self.closed = name, fail_at, [], False

  def write_scalars(self, step, scalars):
    if self.fail_at is not None and step >= self.fail_at:
      raise OSError(28, "No space left on device")
    self.rows.append(step)

  def close(self):
    self.closed = True


def test_a_failing_side_channel_is_turned_off_once_and_the_rest_goes_on(caplog):
  jsonl, board = _Fake("metrics.jsonl"), _Fake("TensorBoard (events)", fail_at=2)
  multi = writers.MultiWriter([writers.LoggingWriter(), board, jsonl], required=[jsonl])
  with caplog.at_level("WARNING"):
    for step in range(1, 5):
      multi.write_scalars(step, {"x": 1.0})
    multi.flush()
    multi.close()
  assert jsonl.rows == [1, 2, 3, 4] and board.rows == [1] and board.closed and jsonl.closed
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warnings == ["TensorBoard (events) failed (OSError: [Errno 28] No space left on device) and is turned off "
                      "for the rest of the run (the last row it took: step 1); still written: the log lines, "
                      "metrics.jsonl."], warnings


def test_the_required_log_or_the_last_record_failing_stops_the_run_in_one_line():
  jsonl, board = _Fake("metrics.jsonl", fail_at=3), _Fake("TensorBoard (events)")
  multi = writers.MultiWriter([board, jsonl], required=[jsonl])
  multi.write_scalars(2, {"x": 1.0})
  with pytest.raises(writers.LogWriteError) as failed:
    multi.write_scalars(3, {"x": 1.0})
  assert str(failed.value).startswith("writing metrics.jsonl failed: OSError: [Errno 28] No space left on device "
                                      "(the last row it took: step 2)."), failed.value
  multi.close()  # the failed one is not closed again (its buffer would fail the same way)
  only = _Fake("TensorBoard (events)", fail_at=1)
  with pytest.raises(writers.LogWriteError, match="^writing TensorBoard"):
    writers.MultiWriter([writers.LoggingWriter(), only]).write_scalars(1, {"x": 1.0})


# main.py on a disk that fills up: TensorBoard's writes fail from its 4th record on (turned off, the run goes
# on), then metrics.jsonl's from the rows of step 9 on (the run stops, after its checkpoint of step 6).
_DISK_FILLS_UP = textwrap.dedent("""
    import runpy, sys
    from tensorboard.summary.writer import record_writer
    from noloco_jax.io import writers
    def failing(cls, method, fails):
      real = getattr(cls, method)
      def write(self, *args):
        if fails(*args):
          raise OSError(28, "No space left on device")
        return real(self, *args)
      setattr(cls, method, write)
    records = [0]
    def fourth_record(*_):
      records[0] += 1
      return records[0] > 4
    failing(record_writer.RecordWriter, "write", fourth_record)
    failing(writers.JsonlWriter, "write_scalars", lambda step, scalars: step >= 9)
    sys.argv[0] = "noloco_jax.main"
    runpy.run_module("noloco_jax.main", run_name="__main__", alter_sys=True)
""")


def test_a_disk_that_fills_up_turns_tensorboard_off_then_stops_the_run_in_one_line(cache, tmp_path):
  """Before: TensorBoard's failed write ended the run with a traceback, and a failed write of metrics.jsonl
  printed three tracebacks (the write, the close after it, the run's) and a generic last line."""
  workdir, log = str(tmp_path / "run"), str(tmp_path / "run.log")
  with open(log, "w") as out:
    code = subprocess.run([sys.executable, "-c", _DISK_FILLS_UP, *SMOKE, f"--workdir={workdir}"], cwd=REPO,
                          env=cache, stdout=out, stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S).returncode
  lines = stderr_of(log)
  assert code == 1, lines[-30:]
  assert not [l for l in lines if "Traceback" in l], lines[-40:]
  warned = [l for l in lines if "TensorBoard (" in l and "is turned off" in l]
  assert len(warned) == 1 and "still written: the log lines, metrics.jsonl." in warned[0], warned
  assert _steps(workdir) == [3, 6]  # TensorBoard's failure lost none of them
  assert lines[-1].startswith("noloco_jax: error: writing metrics.jsonl failed: OSError: [Errno 28] No space left on "
                              "device (the last row it took: step 6)."), lines[-1]
  assert lines[-1].endswith(f"Then run the same command to resume from the last checkpoint (step 6 in {workdir})."), lines[-1]


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return sorted({json.loads(line)["step"] for line in f if "train/loss" in line})


def _children(pid):
  out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
  return [(int(p), args) for p, _, args in (line.strip().partition(" ") for line in out.splitlines())]


def test_the_wandb_service_killed_mid_run_turns_wandb_off_and_the_run_goes_on(cache, tmp_path):
  pytest.importorskip("wandb", reason="needs wandb: pip install '.[wandb]'")
  workdir, log = str(tmp_path / "run"), str(tmp_path / "run.log")
  # Without WANDB_SERVICE: wandb.init in this worker (tests/test_wandb.py, same xdist worker) leaves it in
  # os.environ, and a run that inherits it joins that worker's service instead of starting its own
  # wandb-core, so there was nothing of the run's to kill (the fresh-clone suite's failure). 0.25 s a step
  # keeps the run going ≥ 6 s after its first row, so the kill lands mid-run.
  env = {k: v for k, v in cache.items() if k != "WANDB_SERVICE"}
  env.update(WANDB_SILENT="true", NOLOCO_FAULTS="delay:seconds=0.25")
  with open(log, "w") as out:
    proc = subprocess.Popen([sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke",
                             "--config.num_steps=24", "--config.checkpoint_every=0", "--config.wandb.project=p",
                             "--config.wandb.mode=offline", f"--workdir={workdir}"], cwd=REPO,
                            env=env, stdout=out, stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline and proc.poll() is None:
      core = [p for p, args in _children(proc.pid) if "wandb-core" in args]
      if core and os.path.exists(os.path.join(workdir, "metrics.jsonl")) and _steps(workdir):
        os.kill(core[0], signal.SIGKILL)  # W&B's service dies while the run trains
        break
      time.sleep(0.05)
    else:
      pytest.fail("the run ended before W&B's service could be killed:\n" + "\n".join(stderr_of(log)[-30:]))
    code = proc.wait(timeout=START_TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
  lines = stderr_of(log)
  assert code == 0, lines[-40:]
  assert not [l for l in lines if "Traceback" in l], lines[-60:]
  warned = [l for l in lines if "Weights & Biases failed" in l]
  assert len(warned) == 1 and "still written: the log lines, TensorBoard (" in warned[0], warned
  assert _steps(workdir) == list(range(3, 25, 3))
