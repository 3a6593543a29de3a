"""Reading an asynchronous job's logs (noloco_jax/asynchronous/logs.py) and the job's own series, on a job
directory written here (no JAX, no processes): how each process ended, times relative to the job's start,
the merged rows, and the report of a job's workdir (noloco_jax/report.py)."""

import json
import os
import subprocess
import sys

import pytest

from noloco_jax import report
from noloco_jax.asynchronous import logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = 1795825300.0  # the job's first event, by the processes' clocks


def _write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def write_job(root, *, lost=2, summary=None):
  """Three processes, 12 steps, H = 3: 0 and 1 finish, `lost` dies after step 6 (its peers see it lost)."""
  config = {"num_steps": 12, "num_replicas": 1, "data": {"batch_size": 2, "seq_len": 8},
            "outer": {"kind": "noloco", "schedule": "async"}}
  for slot in range(3):
    d = os.path.join(root, f"process_{slot}")
    last = 6 if slot == lost else 12
    rows = [{"step": 0, "eval/loss": 5.0, "eval/ppl": 148.4, "replicas/weight_std": 0.0}]
    for step in range(3, last + 1, 3):
      rows.append({"step": step, "train/loss": 5.0 - step / 10 - slot / 100, "perf/steps_per_s": 2.0 + slot,
                   "perf/tokens_per_s": 32.0 * (2.0 + slot), "comm/bytes_sent_per_replica": 100.0 * step,
                   "outer/round": step // 3, "replicas/weight_std": 0.0})
      if step % 6 == 0:
        rows.append({"step": step, "eval/loss": 4.9 - step / 10 - slot / 100, "replicas/weight_std": 0.0,
                     "eval/consensus_loss": 4.8})
    _write(os.path.join(d, "metrics.jsonl"), rows)
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(config, f)
    events = [{"time": T0 + 0.5 * slot + 0.1 * s, "slot": s, "incarnation": 10 + s, "event": "joined"} for s in range(3)]
    if slot != lost:
      events.append({"time": T0 + 20.0 + slot, "slot": lost, "incarnation": 10 + lost, "event": "lost"})
      events += [{"time": T0 + 40.0 + slot, "slot": s, "incarnation": 10 + s, "event": "left"}
                 for s in range(3) if s not in (slot, lost)]
    _write(os.path.join(d, f"membership_{slot}.jsonl"), events)
    _write(os.path.join(d, f"pairings_{slot}.jsonl"),
           [{"time": T0 + 5.0 * r, "slot": slot, "status": "exchanged", "group": [0, 1]} for r in range(1, 3)])
  if summary is not None:
    with open(os.path.join(root, "summary.json"), "w") as f:
      json.dump(summary, f)
  return str(root)


def test_the_summary_says_how_each_process_ended_at_times_from_the_jobs_start(tmp_path):
  """Issue 34 item 6: the tool printed raw epoch seconds (`seen by process 0 at 1795825363.0`) and said
  "left" for a process that had finished normally."""
  text = "\n".join(logs.summary(logs.merge(write_job(tmp_path))))
  assert "process 0: finished at step 12 of 12, eval/loss 3.7000 (step 12)" in text, text
  assert "process 2: lost at step 6 of 12" in text, text
  assert "slot 2 lost (seen by processes 0, 1, first +20.0 s)" in text, text
  assert "slot 1 finished (seen by process 0, first +40.0 s)" in text, text
  assert "slot 0 finished (seen by process 1, first +41.0 s)" in text, text
  assert " left" not in text and "17958" not in text, text


def test_a_process_that_left_before_its_last_step_is_stopped_not_finished(tmp_path):
  root = write_job(tmp_path)
  rows = [r for r in logs._jsonl(os.path.join(root, "process_1", "metrics.jsonl")) if r["step"] <= 9]
  _write(os.path.join(root, "process_1", "metrics.jsonl"), rows)  # process 1 stopped (SIGTERM) after step 9
  merged = logs.merge(root)
  assert [logs.ending(merged, s) for s in (0, 1, 2)] == ["finished", "stopped", "lost"]
  text = "\n".join(logs.summary(merged))
  assert "slot 1 stopped before its last step (left the rounds at step ≤ 9)" in text, text


def test_the_jobs_rows_are_the_means_over_the_processes_that_logged_each_step(tmp_path):
  merged = logs.merge(write_job(tmp_path))
  rows = {(r["step"], "train/loss" in r): r for r in logs.job_rows(merged)}
  assert rows[(6, True)]["train/loss"] == pytest.approx((4.4 + 4.39 + 4.38) / 3)
  assert rows[(6, True)]["job/processes"] == 3 and rows[(9, True)]["job/processes"] == 2  # process 2 was lost
  assert rows[(9, True)]["train/loss"] == pytest.approx((4.1 + 4.09) / 2)
  assert rows[(6, True)]["perf/steps_per_s"] == 2.0  # the slowest process
  assert rows[(6, True)]["perf/tokens_per_s"] == pytest.approx(32.0 * (2 + 3 + 4))  # every process's together
  assert rows[(12, False)]["eval/loss"] == pytest.approx((3.7 + 3.69) / 2)
  # A process's spread (0: one replica) and its own φ's loss say nothing about the job: left out.
  assert not any(k in r for r in rows.values() for k in logs.NOT_THE_JOBS)
  assert logs.job_config(merged)["num_replicas"] == 3


def test_report_reads_a_jobs_workdir_as_one_run(tmp_path, capsys):
  """Issue 33 item 8: `report WORKDIR` of an asynchronous job said it had no metrics."""
  root = write_job(tmp_path / "job")
  run = report.Run(root)
  assert run.processes == [0, 1, 2] and run.summary is None and run.tokens_per_step == 3 * 2 * 8
  assert list(run.series("train/loss")[0]) == [3, 6, 9, 12]
  assert report.main([root, "--no-png"]) == 0
  out = capsys.readouterr().out
  assert "job: noloco, 3 replicas, step 12 of 12 (in progress)" in out
  assert f"its spread and consensus model are not computed yet: python -m noloco_jax.asynchronous.result {root}" in out
  # With the job's result (asynchronous/result.py), its spread and consensus loss at the checkpoints' step.
  done = write_job(tmp_path / "done", summary={"job": "asynchronous", "replicas/weight_std": 2e-3,
                                               "eval/consensus_loss": 3.6,
                                               "per_process": {"0": {"checkpoint_step": 12}, "1": {"checkpoint_step": 12},
                                                               "2": {"checkpoint_step": 6}}})
  run = report.Run(done)
  assert run.summary is not None
  steps, values, _ = run.series("replicas/weight_std")
  assert (list(steps), list(values)) == ([12], [2e-3])
  assert list(run.series("eval/consensus_loss")[1]) == [3.6]
  assert "(finished)" in "\n".join(report.summarize(run))


def test_the_report_and_the_logs_tool_import_no_jax():
  code = "import sys, noloco_jax.report, noloco_jax.asynchronous.logs; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == "False", out.stderr
