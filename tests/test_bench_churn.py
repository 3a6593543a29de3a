"""experiments/bench_churn.py (issue 38.1): its failure trace (a seeded Poisson process per process, the
same for every method), its accounting of goodput and lost time and its audit on synthetic runs, its
targets, its one-line errors, and the benchmark itself in its seconds-long mode (--quick)."""

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments import bench_churn  # noqa: E402
from experiments.lib import churn  # noqa: E402


def test_the_failure_trace_is_a_seeded_poisson_process_per_process():
  trace = churn.failure_trace(3, 8, 50.0, 100.0)
  assert trace == churn.failure_trace(3, 8, 50.0, 100.0)  # every method meets the same failures
  assert trace != churn.failure_trace(4, 8, 50.0, 100.0)
  assert trace == sorted(trace) and all(0 <= t < 100.0 and 0 <= p < 8 for t, p in trace)
  # A process's failures do not depend on how many processes there are (its draws: (seed, process) alone).
  assert [e for e in churn.failure_trace(3, 4, 50.0, 100.0)] == [e for e in trace if e[1] < 4]
  assert churn.failure_trace(0, 8, math.inf, 100.0) == []
  # Counts over a horizon are Poisson(horizon / mtbf); intervals exponential with mean mtbf.
  counts = [sum(1 for _, p in churn.failure_trace(seed, 1, 20.0, 100.0)) for seed in range(2000)]
  assert np.mean(counts) == pytest.approx(5.0, rel=0.05) and np.var(counts) == pytest.approx(5.0, rel=0.12)
  gaps = np.diff([t for t, _ in churn.failure_trace(0, 1, 20.0, 200000.0)])
  assert stats.kstest(gaps, "expon", args=(0, 20.0)).pvalue > 0.01


def _rows(first, last, h):
  return [{"step": s, "end": float(s)} for s in range(first, last + 1)]


def _metrics(steps, h, evals=3.5):
  return [{"step": s, "train/loss": 4.0} for s in steps] + [{"step": steps[-1], "eval/loss": evals}]


def test_async_accounting_counts_a_killed_incarnation_up_to_its_last_exchange():
  # Slot 0: steps 1-10, killed at t = 10.5 at step 10, its last exchange at step 8; restarted, joined a peer at
  # step 12 and trained to step 20. Slot 1 never failed: steps 1-20.
  kill = {"time": 10.5, "process": 0, "step": 10, "last_exchanged": 8}
  run = {"method": "async", "kills": [kill], "end": 40.0,
         "traces": [_rows(1, 10, 5) + [{"step": s, "end": 12.0 + s} for s in range(13, 21)], _rows(1, 20, 5)]}
  steps, lost = churn.contributed_steps(run)
  assert steps == 8 + (20 - 12) + 20 and lost == [{"steps": 2}]
  # Steps that ended after the budget (19 and 20 end at 31 and 32) do not count.
  assert churn.contributed_steps({**run, "end": 30.0})[0] == 8 + (18 - 12) + 20
  assert churn.downtime(run) == [pytest.approx(25.0 - 10.5)]  # to its first step after the restart (step 13)
  run["rows"] = [_metrics([5, 10, 15, 20], 5), _metrics([5, 10, 15, 20], 5)]
  assert churn.audit_rows(run, 5) == 0
  run["rows"][1] = _metrics([5, 10, 10, 20], 5)  # step 10 twice, step 15 missing
  assert churn.audit_rows(run, 5) == 2


def test_a_restart_that_redoes_steps_counts_them_once():
  # Killed at step 10 (last exchange 10), resumed from its own checkpoint of step 6 and trained to 14.
  kill = {"time": 10.5, "process": 0, "step": 10, "last_exchanged": 10}
  run = {"method": "async", "kills": [kill], "end": 40.0,
         "traces": [_rows(1, 10, 5) + [{"step": s, "end": 20.0 + s} for s in range(7, 15)]]}
  assert churn.contributed_steps(run)[0] == 14


def test_the_last_evaluations_outside_the_peers_spread_count_as_corrupt(tmp_path):
  dirs = [str(tmp_path / f"process_{p}") for p in range(4)]  # no checkpoints: every evaluation counts
  start = [{"step": 0, "eval/loss": 5.52}]
  run = {"method": "async", "dirs": dirs, "rows": [start + _metrics([5], 5, v) for v in (3.50, 3.52, 3.49, 5.6)]}
  assert churn.audit_states(run)[0] == 1  # reset to random weights: worse than at step 0
  run["rows"][3] = start + _metrics([5], 5, float("nan"))
  assert churn.audit_states(run)[0] == 1
  run["rows"][3] = start + _metrics([5], 5, 4.9)  # below the start, but far outside its peers' spread
  assert churn.audit_states(run)[0] == 1
  run["rows"][3] = start + _metrics([5], 5, 4.3)  # behind its peers, not corrupt
  assert churn.audit_states(run)[0] == 0
  # A lock-step job that never saved past step 0: its surviving model is the initial one (no goodput), not a
  # corrupt state; a non-finite evaluation there still is.
  job = {"method": "noloco", "dirs": [str(tmp_path / "job")], "rows": [start]}
  assert churn.audit_states(job)[0] == 0
  job["rows"] = [[{"step": 0, "eval/loss": float("nan")}]]
  assert churn.audit_states(job)[0] == 1
  # A job killed before its first evaluation and checkpoint every time (DDP at mtbf 30 s): no model survived
  # to be corrupt, so nothing to count.
  job["rows"] = [[{"step": 0, "model/num_params": 26784.0}]]
  assert churn.audit_states(job)[0] == 0


def test_the_healthy_pace_is_measured_before_the_first_failure():
  run = {"origin": 0.0, "end": 30.0, "kills": [{"time": 10.0}], "traces": [_rows(1, 30, 5), _rows(1, 20, 5)]}
  assert churn.healthy_rate(run) == pytest.approx(20 / (2 * 10.0))  # steps ending in (0, 10]
  run["kills"] = [{"time": 4.0}]
  assert churn.healthy_rate(run) is None


def test_targets_are_judged_where_every_lockstep_method_is_at_most_0_6():
  def r(method, mtbf, goodput, loss):
    return {"method": method, "mtbf_s": mtbf, "seed": 0, "goodput": goodput, "eval_loss_at_budget": loss,
            "rows_lost": 0, "corrupt_states": 0}
  runs = [r("async", 300, 0.93, 3.4), r("noloco", 300, 0.55, 3.7), r("ddp", 300, 0.4, 3.9),
          r("async", 1200, 0.97, 3.3), r("noloco", 1200, 0.8, 3.3)]
  out = bench_churn.targets(runs)
  assert out["rows_lost_and_corrupt_states_zero"]
  assert [m["mtbf_s"] for m in out["per_seed"]["0"]] == [300]  # at 1200 lock-step NoLoCo is above 0.6
  assert out["per_seed"]["0"][0]["async_goodput_at_least_0.9"] and out["per_seed"]["0"][0]["async_loss_below_every_lockstep"]
  # Repeated runs of a method at one rate and seed are judged on their mean, not on whichever came last.
  again = bench_churn.targets(runs + [r("async", 300, 0.85, 3.95)])["per_seed"]["0"][0]
  assert again["runs"] == {"async": 2, "ddp": 1, "noloco": 1}
  assert again["async_goodput"] == pytest.approx(0.89) and not again["async_goodput_at_least_0.9"]
  assert again["async_loss_below_every_lockstep"]  # mean 3.675 against NoLoCo's 3.7 and DDP's 3.9 (the last run alone: 3.95)


def test_every_method_warms_the_compilation_cache_before_the_first_measured_run(tmp_path, monkeypatch):
  """Failure-free, --warm_s long, into the sweep's cache, under warm/; then the measured runs (here each
  fails to start, so the sweep ends with no healthy pace)."""
  calls = []

  def run(method, root, s, trace):
    calls.append((method, os.path.relpath(root, tmp_path), s.mtbf_s, s.budget_s, s.compile_cache, list(trace)))
    if math.isfinite(s.mtbf_s):
      raise RuntimeError("did not start")

  monkeypatch.setattr(churn, "run", run)
  with pytest.raises(RuntimeError, match="no healthy pace"):
    bench_churn.main(["--processes", "2", "--methods", "async", "ddp", "--mtbf_s", "50", "--seeds", "3",
                      "--warm_s", "7", "--keep", str(tmp_path)])
  cache = str(tmp_path / "compile_cache")
  assert calls[:2] == [("async", "warm", math.inf, 7.0, cache, []), ("ddp", "warm", math.inf, 7.0, cache, [])]
  assert [(c[0], c[1], c[3], c[4]) for c in calls[2:]] == [("async", ".", 180.0, cache), ("ddp", ".", 180.0, cache)]
  calls.clear()
  with pytest.raises(RuntimeError, match="no healthy pace"):  # no cache, nothing to warm
    bench_churn.main(["--processes", "2", "--methods", "async", "--mtbf_s", "50", "--compile_cache", "off",
                      "--keep", str(tmp_path)])
  assert [c[1] for c in calls] == [".", "."]


@pytest.mark.parametrize("flags, message", [
    (["--mtbf_s", "300", "-5"], "--mtbf_s=-5 is not valid: the mean seconds between failures of one process, > 0"),
    (["--restart_delay_s", "-1"], "--restart_delay_s=-1 is not valid: seconds ≥ 0 and below --budget_s=180"),
    (["--restart_delay_s", "200"], "--restart_delay_s=200 is not valid"),
    (["--methods", "async", "gossip"], "--methods: 'gossip' is not valid"),
    (["--warm_s", "-1"], "--warm_s=-1 is not valid: seconds ≥ 0 (0: no warm-up)"),
])
def test_a_rate_or_delay_out_of_range_is_one_line_naming_the_flag(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    bench_churn.main(flags)
  out = capsys.readouterr()
  assert e.value.code == 2 and out.out == ""
  assert out.err.strip().splitlines() == [f"noloco_jax: {message}" + out.err.strip().split(message, 1)[1]]


@pytest.mark.exhaustive(reason="bench_churn end to end (its failure trace, accounting, audits, targets and errors: the "
                        "rest of this file; a killed asynchronous process rejoining a live job: tests/test_async_churn.py "
                        "and tests/test_async_driver.py; a lock-step job restarted from its checkpoint after SIGKILL, "
                        "every row once: tests/test_checkpoint.py)")
def test_quick_mode_runs_both_schedules_under_the_same_failures(tmp_path):
  """P = 2, asynchronous and lock-step NoLoCo, failures every 12 s per process on average for 20 s (two)."""
  out = subprocess.run([sys.executable, "experiments/bench_churn.py", "--quick", "--json", "--keep", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  runs = {r["method"]: r for r in result["runs"]}
  assert set(runs) == {"async", "noloco"}
  trace = churn.failure_trace(0, 2, 12.0, 20.0)
  for r in runs.values():
    assert r["failures"] + r["failures_skipped"] == len(trace)
    assert r["rows_lost"] == 0 and r["corrupt_states"] == 0, r
    assert 0 < r["goodput"] <= 1.05 and r["eval_loss_at_budget"] is not None and math.isfinite(r["eval_loss_at_budget"])
    # Against its own pace (never faster than the sweep's best), a run's goodput is at least the sweep-wide one.
    assert r["goodput_own_pace"] is None or r["goodput_own_pace"] >= r["goodput"] - 1e-9
  assert runs["async"]["failures"] >= 1
  # A sweep cut short is accounted from the raw runs it saved: the same records.
  raw = sorted(str(p) for p in tmp_path.glob("raw_*.json"))
  again = subprocess.run([sys.executable, "experiments/bench_churn.py", "--from_raw", *raw, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert json.loads(again.stdout.strip().splitlines()[-1])["runs"] == result["runs"]


def test_a_restarts_time_is_split_into_its_stages_from_the_logs(tmp_path):
  """Killed at t0 + 10, launched again at + 15: its log's stage lines at + 17 (imports), + 18 (start-up check),
  + 18.5 (restored), + 20 (joined), + 20.4 (compiled), its first step at + 21. A kill whose restart did not
  step before the next kill has no record."""
  t0 = 1795854000.0
  stamp = lambda t: time.strftime("I%m%d %H:%M:%S", time.localtime(t)) + f".{int(round((t % 1) * 1e6)):06d} 1 "
  lines = [(17.0, "main.py:68] Persistent compilation cache: /c"), (18.0, "distributed.py:351] Start-up check: 1 processes agree on"),
           (18.5, "restoring.py:90] checkpoint: resumed from step 60"), (20.0, "asynchronous.py:164] Slot 0 joined the running job"),
           (20.4, "asynchronous.py:143] Asynchronous rounds: 7 programs compiled in 0.4 s."), (20.6, "writers.py:193] [0] x = 1")]
  logs = tmp_path / "logs"
  logs.mkdir()
  (logs / "process_0.log").write_text("".join(stamp(t0 + t) + text + "\n" for t, text in lines) + "a line with no stamp\n")
  (logs / "process_1.log").write_text("")
  run = {"method": "async", "origin": t0, "end": t0 + 60, "logs": str(logs),
         "kills": [{"time": t0 + 10, "process": 0}, {"time": t0 + 40, "process": 1}, {"time": t0 + 50, "process": 1}],
         "launches": [(t0, [0, 1]), (t0 + 15, [0]), (t0 + 45, [1])],
         "traces": [[{"step": 1, "end": t0 + 1}, {"step": 2, "end": t0 + 21}], [{"step": 1, "end": t0 + 1}]]}
  (record,) = churn.phases(run)
  # Another slot's failure while slot 0 restarts does not hide slot 0's restart.
  other = {**run, "kills": run["kills"] + [{"time": t0 + 19.0, "process": 1}]}
  assert len(churn.phases(other)) == 1
  expected = {"delay": 5.0, "start_up": 2.0, "init": 1.0, "restore": 0.5, "join": 1.5, "compile": 0.4, "first_step": 0.6}
  assert record.keys() == expected.keys()
  assert all(record[k] == pytest.approx(v, abs=1e-3) for k, v in expected.items()), record
  assert churn.phases({k: v for k, v in run.items() if k != "launches"}) == []  # a run saved before launches were kept


def test_a_step_that_ends_between_the_kills_record_and_its_signal_is_the_old_incarnations():
  """Slot 0's step 11 ended at 10.6, after the kill was recorded (10.5) but before the signal; relaunched at
  15.5, it joined a peer at step 16 and trained 17-20: no row of 12-15 is owed by the new incarnation."""
  kill = {"time": 10.5, "process": 0, "step": 11, "last_exchanged": 10}
  run = {"method": "async", "kills": [kill], "end": 40.0, "launches": [(0.0, [0, 1]), (15.5, [0])],
         "traces": [_rows(1, 10, 5) + [{"step": 11, "end": 10.6}] + [{"step": s, "end": 20.0 + s} for s in range(17, 21)],
                    _rows(1, 20, 5)],
         "rows": [_metrics([5, 10, 20], 5), _metrics([5, 10, 15, 20], 5)]}
  assert churn.audit_rows(run, 5) == 0
  assert churn.contributed_steps(run) == (10 + (20 - 16) + 20, [{"steps": 1}])
  # Cut at the kill's record instead (a run saved without its launches), the new incarnation seems to start
  # at step 11 and to owe the rows of 15: the audit this replaced counted it lost.
  assert churn.audit_rows({k: v for k, v in run.items() if k != "launches"}, 5) == 1


def test_a_lockstep_jobs_downtime_runs_to_the_restarted_jobs_first_step():
  """Process 0 of a two-process lock-step job was killed at 10.5; process 1 ended a step at 10.6, before
  its own signal; the job was launched again at 15.5 and stepped at 40: 29.5 s down, not 0.1 s."""
  run = {"method": "noloco", "end": 60.0, "kills": [{"time": 10.5, "process": 0}],
         "launches": [(0.0, [0, 1]), (15.5, [0, 1])],
         "traces": [_rows(1, 10, 5) + [{"step": 11, "end": 40.0}], _rows(1, 10, 5) + [{"step": 11, "end": 10.6}, {"step": 11, "end": 40.0}]]}
  assert churn.downtime(run) == [pytest.approx(29.5)]


def test_every_methods_processes_get_the_same_compilation_cache(tmp_path):
  """--compile_cache reaches each process's environment (runtime/compile_cache.py reads NOLOCO_COMPILE_CACHE),
  every program written; 'off' turns it off; '' leaves the processes' default."""
  def env(cache):
    s = churn.Setting(2, 20.0, 12.0, 1.0, 0.1, 5, 20, 20, 1.0, 0, 1.0, 3.0, 5.0, cache)
    return churn._Procs("noloco", str(tmp_path / f"w{len(cache)}"), s).env
  on = env(str(tmp_path / "cache"))
  assert on["NOLOCO_COMPILE_CACHE"] == str(tmp_path / "cache") and on["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
  off = env("off")
  assert off["NOLOCO_COMPILE_CACHE"] == "off" and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in off
  assert "NOLOCO_COMPILE_CACHE" not in env("")
