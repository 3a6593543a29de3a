"""experiments/bench_network.py: its summaries of step traces and its model column on synthetic
inputs, then the benchmark itself in its seconds-long mode (--quick) for each of its settings: a
straggler, seeded log-normal delays, and (root, in a network namespace) a bandwidth limit.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments import bench_network  # noqa: E402


def _trace(inner_s, round_s, slept_s, steps, h, start=0.0):
  rows, t = [], start
  for step in range(1, steps + 1):
    r = round_s if step % h == 0 else 0.0
    t += inner_s + r + slept_s
    rows.append({"step": step, "inner_s": inner_s, "round_s": r, "slept_s": slept_s, "end": t})
  return rows


def test_summary_of_a_straggler_and_a_waiting_peer():
  # Process 0 computes 0.2 s a step, process 1 0.1 s and waits 0.3 s per round of H = 3 for it.
  h, steps = 3, 9
  run = {"traces": [_trace(0.0, 0.0, 0.2, steps, h), _trace(0.0, 0.3, 0.1, steps, h)],
         "last_row": {"comm/bytes_sent_per_replica": 1234.0, "comm/bytes_received_per_replica": 1234.0,
                      "comm/collective_operand_bytes_per_replica": 1000.0}}
  out = bench_network.summarise("diloco", run, h, tokens_per_step=64)
  assert out["idle_fraction"] == pytest.approx([0.0, 0.5])  # 0.3 / (0.3 + 3 × 0.1)
  assert out["wall_s_per_round"] == pytest.approx(0.6) and out["longest_round_s_median"] == pytest.approx(0.6)
  assert out["tokens_per_s"] == pytest.approx(6 * 64 / 1.2)  # steps 4..9 over the slowest process's time
  assert out["bytes_sent_per_replica"] == 1234.0


def test_ddp_wait_is_the_inner_time_beyond_the_collective_free_reference():
  h, steps = 3, 6
  run = {"traces": [_trace(0.25, 0.0, 0.0, steps, h), _trace(0.25, 0.0, 0.0, steps, h)], "last_row": {}}
  out = bench_network.summarise("ddp", run, h, 64, reference_inner_s=[0.25, 0.05])
  assert out["idle_fraction"] == pytest.approx([0.0, 0.8])


def test_model_column_is_latency_py_on_the_runs_groupings():
  # P = 4, process 0 a 2× straggler, H = 1 step of 1 s: compute [2, 1, 1, 1] per round.
  steps = bench_network.latency.straggler_step_times(4, 3, 1.0, 2.0)
  groups = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]]
  noloco = bench_network.model("noloco", steps, 1, groups, 100.0, 0.0, 0.0, 0.0, tokens_per_step=64)
  np.testing.assert_allclose(noloco["idle_fraction"], [0.0, 1 / 3, 2 / 4, 3 / 5])  # tests/test_latency.py
  diloco = bench_network.model("diloco", steps, 1, None, 100.0, 0.0, 0.0, 0.0, tokens_per_step=64)
  np.testing.assert_allclose(diloco["idle_fraction"], [0.0, 0.5, 0.5, 0.5])
  assert diloco["wall_s_per_round"] == pytest.approx(2.0) and diloco["tokens_per_s"] == pytest.approx(4 * 64 / 2)
  # DDP: a barrier every step; H = 3 steps of 1 s (2 s on the straggler), the first round left out.
  ddp = bench_network.model("ddp", bench_network.latency.straggler_step_times(2, 6, 1.0, 2.0), 3, None,
                            100.0, 0.0, 0.0, 0.0, tokens_per_step=64)
  assert ddp["wall_s_per_round"] == pytest.approx(6.0) and ddp["idle_fraction"] == pytest.approx([0.0, 0.5])


def test_fitted_alpha_is_the_stragglers_wait_beyond_the_model():
  setting = {"steps": 6, "inner_steps": 2, "step_s": 1.0, "straggler_factor": 2.0, "lognormal": None,
             "model_alpha_s": 0.0, "model_beta_s_per_byte": 0.0, "model_burst_bytes": 0.0}
  # DiLoCo, 2 processes, rounds of 2 steps: compute [4, 2] s a round; 2 rounds measured. The straggler
  # waited 0.2 s in them (the all-reduce's own cost): α = 0.1 s per exchange.
  run = {"processes_count": 2, "method": "diloco", "groups": None, "collective_operand_bytes_per_replica": 300.0,
         "bytes_sent_per_replica": 300.0, "processes": [{"wait_s": 0.2}, {"wait_s": 4.5}]}
  bench_network.attach_models(setting, run)
  assert run["model"]["wait_s_per_round"] == pytest.approx([0.0, 2.0])
  assert run["model_fitted"]["alpha_s"] == pytest.approx(0.1)
  assert run["model_fitted"]["wall_s_per_round"] == pytest.approx(4.1)
  assert run["model_fitted"]["idle_fraction"] == pytest.approx([0.1 / 4.1, 2.1 / 4.1])


def test_rate_and_burst_strings_are_tcs():
  assert bench_network.rate_bits_per_s("10mbit") == 10e6 and bench_network.rate_bits_per_s("500kbit") == 5e5
  assert bench_network.size_bytes("128kb") == 128 * 1024 and bench_network.size_bytes("1500") == 1500
  with pytest.raises(SystemExit, match="--rate='10mbps' is not valid"):
    bench_network.rate_bits_per_s("10mbps")


# ---- The benchmark itself, in its seconds-long mode (--quick: P = 2, 6 steps, H = 2) ----


def _quick(*flags, methods=("noloco", "diloco")):
  """Runs `bench_network.py --quick FLAGS` as its own program; the results it prints last."""
  cmd = [sys.executable, os.path.join(REPO, "experiments", "bench_network.py"), "--quick", *flags,
         "--methods", *methods]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  assert [r["method"] for r in results["runs"]] == list(methods)
  for run in results["runs"]:
    for key in ("wall_s_per_round", "tokens_per_s", "bytes_sent_per_replica", "idle_fraction", "program_wait_s", "model"):
      assert key in run, key
    assert len(run["idle_fraction"]) == 2 and all(0.0 <= x <= 1.0 for x in run["idle_fraction"])
    assert run["bytes_sent_per_replica"] > 0 and run["tokens_per_s"] > 0
  return results


def test_async_summary_and_validation_loss_over_time():
  """Two processes of an asynchronous job: process 0 two rounds of 0.4 s, process 1 four of 0.2 s with 0.1 s
  of waiting in each; evaluations every round (the step-0 one at −inf)."""
  from experiments.lib import async_runs  # pylint: disable=g-import-not-at-top
  h = 2
  traces = [_trace(0.0, 0.0, 0.2, 6, h, start=10.0), _trace(0.0, 0.1, 0.1, 12, h, start=10.0)]
  rows = [[{"step": 0, "eval/loss": 5.0}, {"step": 2, "eval/loss": 4.0}, {"step": 4, "eval/loss": 3.0},
           {"step": 6, "train/loss": 1.0, "comm/bytes_sent_per_replica": 100.0, "async/exchanged_rounds": 3}],
          [{"step": 0, "eval/loss": 5.0}, {"step": 4, "eval/loss": 3.5},
           {"step": 12, "train/loss": 1.0, "comm/bytes_sent_per_replica": 300.0, "async/exchanged_rounds": 5,
            "async/skipped_rounds": 1}]]
  pairings = [[{"status": "exchanged", "exchange_s": 0.01, "waited_s": 0.2}],
              [{"status": "exchanged", "exchange_s": 0.03, "waited_s": 0.0},
               {"status": "skipped", "exchange_s": 0.0, "waited_s": 0.1}]]
  run = {"traces": traces, "rows": rows, "pairings": pairings}
  out = async_runs.summarise(run, h, tokens_per_step=64)
  assert out["idle_fraction"] == pytest.approx([0.0, 1 / 3])  # per round: 0.1 s waiting of 0.3 s
  assert out["tokens_per_s"] == pytest.approx((4 + 10) * 64 / 1.5)  # steps after the first round / longest span
  assert out["bytes_sent_per_replica"] == 200.0 and out["rounds"] == {"exchanged": 8, "skipped": 1, "failed": 0}
  assert out["exchange_s_median"] == pytest.approx(0.02)
  # Per round, from the second round on: in rounds 0 (process 0) and 0.1 s (process 1); waiting: the one
  # row after each process's first, process 1's skip.
  assert out["round_breakdown"]["round_s"] == pytest.approx(0.05) and out["round_breakdown"]["waiting_s"] == pytest.approx(0.1)
  assert out["round_breakdown"]["other_s"] is not None and not out["round_breakdown"]["overlapped"]
  # Rounds on their own thread: their waiting and exchange overlap the steps, so nothing is left to call
  # "other" (subtracting them gave a negative time).
  overlapped = async_runs.summarise(run, h, tokens_per_step=64, overlapped=True)["round_breakdown"]
  assert overlapped["other_s"] is None and overlapped["round_s"] == pytest.approx(0.05)
  assert async_runs.origin(traces) == pytest.approx(10.2)  # both have finished their first step
  curves = async_runs.curves(run)
  assert [v for _, v in curves[0]] == [5.0, 4.0, 3.0] and [t for t, _ in curves[0]] == pytest.approx([-np.inf, 10.4, 10.8])
  assert async_runs.loss_at(curves, 10.5) == pytest.approx((4.0 + 5.0) / 2)  # process 1's step 4 ends at 10.6
  assert async_runs.loss_at(curves, 11.2) == pytest.approx((3.0 + 3.5) / 2)
  assert async_runs.time_of_tokens(traces, 3) == pytest.approx(10.3)  # steps end at 10.1 (p1), 10.2 (p0), 10.3 (p1)
  assert async_runs.time_of_tokens(traces, 100) is None


QUICK = ("bench_network's quick modes (its summaries, the latency model's column and the async summaries: this "
         "file's unit tests; the async schedule itself: tests/test_async_driver.py)")


@pytest.mark.exhaustive(reason=QUICK)
def test_quick_straggler_its_partner_idles_and_the_model_says_half():
  results = _quick(methods=("noloco", "diloco", "async"))
  assert results["runs"][-1]["rounds"]["exchanged"] > 0  # the asynchronous job paired its two processes
  for run in results["runs"]:
    idle = run["idle_fraction"]
    # Process 1 waits ≥ 0.2 s a round for the straggler on top of whatever the exchange costs both;
    # a run without the straggler (or a broken trace) would give the two the same idle time.
    assert idle[1] > idle[0] + 0.1, run
    assert run["model"]["idle_fraction"] == pytest.approx([0.0, 0.5])


@pytest.mark.exhaustive(reason=QUICK)
def test_quick_lognormal_the_model_sees_the_delays_the_run_slept():
  results = _quick("--lognormal", "0.05,0.8", methods=("noloco",))  # one job: the mode, not the method
  for run in results["runs"]:
    slept = [p["slept_s"] for p in run["processes"]]
    np.testing.assert_allclose(slept, run["model"]["busy_s"], rtol=1e-6)  # the same seeded draws
    assert slept[0] != pytest.approx(slept[1])  # each process its own stream


def _can_unshare_with_tc() -> str | None:
  if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
    return "needs root, unshare and tc (iproute2)"
  if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
    return "unshare -n is not permitted here"
  return None


@pytest.mark.exhaustive(reason=QUICK)
@pytest.mark.skipif(_can_unshare_with_tc() is not None, reason=str(_can_unshare_with_tc()))
def test_quick_bandwidth_limit_the_exchange_waits_for_the_link():
  results = _quick("--rate", "1mbit", methods=("diloco",))
  for run in results["runs"]:
    model_wait = run["model"]["wait_s_per_round"][0]  # the straggler waits for nothing but the link
    assert model_wait > 0.3, run["model"]  # 2 copies of 107 kB through 1 Mbit/s, less the 128 kB burst
    measured = run["processes"][0]["wait_s"] / 2  # 2 measured rounds
    # tbf cannot send faster than its rate: the measured wait is at least most of the model's.
    assert measured > 0.6 * model_wait, (measured, model_wait)
