"""experiments/bench_network.py and its parts: per-node links (experiments/lib/node_links.py), the figures
read from a traced job (run_figures.py), the per-node link model (latency.py §10, barrier_sim.py, the
asynchronous law with overlap), the command line's bad input; then, as root in the real tier, the links
themselves (self-test, clean-up) and the benchmark's quick mode on them.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments import bench_network  # noqa: E402
from experiments.lib import jobs, latency, netns, node_links, run_figures  # noqa: E402
from noloco_jax.asynchronous import law  # noqa: E402
from noloco_jax.runtime import faults  # noqa: E402


def _trace(inner_s, round_s, slept_s, steps, h, start=0.0):
  rows, t = [], start
  for step in range(1, steps + 1):
    r = round_s if step % h == 0 else 0.0
    t += inner_s + r + slept_s
    rows.append({"step": step, "inner_s": inner_s, "round_s": r, "slept_s": slept_s, "end": t})
  return rows


def _paced(device_s, inner_s, round_s, steps, h, start=0.0):
  """A paced process's trace rows: each step its device time (or its real compute, when longer)."""
  rows = _trace(inner_s, round_s, max(device_s - inner_s, 0.0), steps, h, start)
  return [{**r, "device_s": device_s} for r in rows]


# ---- Per-node links: their command line ----


def test_links_from_rate_and_rates():
  assert node_links.parse_links("10mbit", "", 3) == [node_links.Link(10e6, 10e6)] * 3
  links = node_links.parse_links("", "2*100mbit,1mbit/2mbit", 3)
  assert links == [node_links.Link(100e6, 100e6)] * 2 + [node_links.Link(1e6, 2e6)]
  assert node_links.parse_links("", "", 2) == [node_links.Link(None, None)] * 2  # unshaped
  burst = int(node_links.tbf_args(100e6, 100)[4])
  assert burst == 50_000 and int(node_links.tbf_args(1e6, 100)[4]) == 4 * node_links.FRAME_BYTES  # ≥ 4 frames


@pytest.mark.parametrize("rate,rates,message", [
    ("10mbps", "", "--rate='10mbps' is not valid"),
    ("", "3*10mbit", "--rates='3\\*10mbit' gives 3 links for 2 processes"),
    ("", "x*10mbit", "is not valid: RATE, UP/DOWN or N\\*RATE"),
    ("", "10mbit/fast", "--rates='fast' is not valid")])
def test_bad_rates_are_one_line_naming_the_flag(rate, rates, message, capsys):
  with pytest.raises(SystemExit) as e:
    node_links.parse_links(rate, rates, 2)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err


@pytest.mark.parametrize("argv,message", [
    (["--links=per_node", "--rate=10mbit"], "--links=per_node needs root"),
    (["--processes", "100000"], "--processes=100000: this machine can place at most"),
    (["--codecs", "noloco=zip"], "--codecs 'noloco=zip' is not valid"),
    (["--codecs", "diloco=bfloat16"], "--codecs 'diloco=bfloat16': diloco's all-reduce carries float32"),
    (["--methods", "async"], "the asynchronous schedule alone has no end; give --budget_s"),
    (["--links=loopback", "--rate=10mbit"], "--links=loopback takes no --rate")])
def test_bad_command_lines_are_one_line(argv, message, capsys, monkeypatch):
  """Checked before anything starts: root first (faked away here), rates, placement, codecs."""
  if "needs root" in message:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(SystemExit) as e:
    bench_network.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err


# ---- Emulated device time ----


def test_device_times_are_what_the_processes_are_paced_to():
  spec = jobs.device_time_faults(0.1, straggler_factor=2.0)
  times = jobs.device_times(3, 4, 0.1, straggler_factor=2.0)
  for p in range(3):
    injector = faults.Injector(faults.parse(spec), p)
    for step in range(1, 5):
      injector.delay_after(step, 0.0)
      assert injector.device_s == pytest.approx(times[step - 1, p])
  assert times[0].tolist() == pytest.approx([0.2, 0.1, 0.1])
  spec = jobs.device_time_faults(0.0, lognormal=(0.1, 0.5), seed=2)
  times = jobs.device_times(2, 5, 0.0, lognormal=(0.1, 0.5), seed=2)
  injector = faults.Injector(faults.parse(spec), 1)
  for step in range(1, 6):
    injector.delay_after(step, 0.0)
    assert injector.device_s == pytest.approx(times[step - 1, 1], rel=1e-12)


# ---- What a traced job's rows say ----


def test_idle_against_device_time_from_the_origin_to_the_budget():
  # Process 0: device 0.2 s a step, real 0.05; process 1: device 0.1 s, real 0.02, 0.3 s in each round of 3.
  h = 3
  traces = [_paced(0.2, 0.05, 0.0, 9, h, start=10.0), _paced(0.1, 0.02, 0.3, 9, h, start=10.0)]
  assert jobs.origin(traces) == pytest.approx(10.2)
  out = run_figures.job_figures(traces, h, 64, budget_s=None)
  assert out["measured_steps"] == [6, 6]
  assert out["idle_fraction"] == pytest.approx([0.0, 0.5])  # 0.6 s of rounds in 1.2 s
  assert out["tokens_per_s"] == pytest.approx(12 * 64 / 1.2)
  assert out["processes"][0]["real_step_share"] == pytest.approx(0.25) and out["overrun_fraction"] == 0.0
  # A budget of 0.8 s from the origin (10.2): steps 4 and 5 end by 11.0 on both (process 1's step 6 and
  # its round end at 11.2).
  cut = run_figures.job_figures(traces, h, 64, budget_s=0.8)  # no evaluations: the clock is the time
  assert cut["measured_steps"] == [2, 2] and cut["measured_s"] == pytest.approx(0.4)
  # A step whose real compute overran its device time: the excess is idle, and reported apart.
  over = run_figures.process_figures(_paced(0.2, 0.25, 0.0, 4, 4))
  assert over["overrun_s"] == pytest.approx(4 * 0.05) and over["idle_fraction"] == pytest.approx(0.2)


def test_a_process_that_started_early_counts_from_the_origin():
  early, late = _paced(0.1, 0.01, 0.0, 10, 2, start=0.0), _paced(0.1, 0.01, 0.0, 10, 2, start=0.5)
  rows = run_figures.measured_rows(early, 2, run_figures.Clock([early, late], None), None)
  assert [r["step"] for r in rows] == [7, 8, 9, 10]  # its steps 3 to 6 ran before the other's first ended (0.6)


def _evaluated(device_s, inner_s, steps, every, seconds, start=0.0):
  """A paced process's rows with an evaluation of `seconds` after every `every`-th step (in the next row)."""
  rows, t = [], start
  for step in range(1, steps + 1):
    inner = inner_s + (seconds if step > 1 and (step - 1) % every == 0 else 0.0)
    slept = max(device_s - inner, 0.0)
    t += inner + slept
    rows.append({"step": step, "inner_s": inner, "round_s": 0.0, "slept_s": slept, "end": t, "device_s": device_s})
  return rows


def test_evaluations_are_left_out_of_the_clock_and_of_the_idle_time():
  # Steps of 0.1 s device time (0.01 real), an evaluation of 2 s after steps 4 and 8 (rows 5 and 9).
  trace = _evaluated(0.1, 0.01, 10, 4, 2.0)
  assert [round(run_figures.barrier_s(r, 4), 6) for r in trace] == [0, 0, 0, 0, 2.0 - 0.09, 0, 0, 0, 2.0 - 0.09, 0]
  clock = run_figures.Clock([trace], 4)
  assert clock.start == pytest.approx(0.1)
  assert clock(trace[-1]["end"]) == pytest.approx(0.9)  # 10 steps of 0.1 s after the first: evaluations out
  figures = run_figures.process_figures(trace[1:], 4)
  assert figures["wall_s"] == pytest.approx(0.9) and figures["idle_fraction"] == pytest.approx(0.0, abs=1e-9)
  assert figures["evaluations_s"] == pytest.approx(2 * 1.91) and figures["overrun_s"] == pytest.approx(0.0)
  # A budget of 0.5 s on the clock: steps 2 to 6 (the first evaluation left out of it).
  assert [r["step"] for r in run_figures.measured_rows(trace, 1, clock, 0.5)] == [2, 3, 4, 5, 6]


def test_curves_target_and_budget():
  traces = [_paced(0.1, 0.01, 0.0, 6, 3, start=0.0), _paced(0.1, 0.01, 0.2, 6, 3, start=0.0)]
  job_rows = [{"step": 0, "eval/loss": 5.0}, {"step": 3, "eval/loss": 4.0}, {"step": 6, "eval/loss": 3.0}]
  curve = run_figures.lockstep_curve(traces, job_rows, run_figures.Clock(traces, None))
  np.testing.assert_allclose(curve, [[0.5 - 0.1, 4.0], [1.0 - 0.1, 3.0]])  # the later process's step end
  assert run_figures.time_to_target(curve, 3.5, None) == pytest.approx(0.9)
  assert run_figures.time_to_target(curve, 3.5, 0.5) is None and run_figures.time_to_target(curve, None, None) is None
  assert run_figures.loss_at_budget(curve, 0.5) == 4.0 and run_figures.loss_at_budget(curve, 0.1) is None


def test_wire_bytes_per_token_outside_the_evaluations():
  # One node, steps of 0.1 s from 0 (origin 0.1), an evaluation of 2 s after step 4; the counter polled
  # every 0.1 s, 1000 bytes a step of training and 50,000 during the evaluation (left out).
  trace = _evaluated(0.1, 0.01, 8, 4, 2.0)
  times = np.arange(0.0, 3.0, 0.1)
  sent = np.cumsum([0] + [50_000 if trace[4]["end"] - 2.0 < t <= trace[4]["end"] else 1000 for t in times[1:]])
  samples = [(t, [int(b)]) for t, b in zip(times, sent)]
  got = run_figures.wire_bytes_per_token(samples, [trace], run_figures.Clock([trace], 4), None, 4, 64)
  assert got == pytest.approx(1000 / 64, rel=0.2)


def test_rounds_skipped_failed_and_in_triples():
  pairings = [[{"status": "exchanged", "group": [0, 1]}, {"status": "skipped", "group": None}],
              [{"status": "exchanged", "group": [0, 1]}, {"status": "exchanged", "group": [1, 2, 3]}],
              [{"status": "failed", "group": [2, 3]}]]
  out = run_figures.async_rounds(pairings)
  assert out == {"rounds": 5, "skipped_fraction": 0.2, "failed_fraction": 0.2, "triples_share": pytest.approx(1 / 3)}
  assert run_figures.async_rounds(pairings, [0])["triples_share"] == 0.0


def test_bytes_per_token_and_per_second():
  out = run_figures.bytes_figures(6400.0, 10, 64, tokens_per_s=256.0, processes=2)
  assert out == {"bytes_per_run": 6400.0, "bytes_per_token": 10.0, "bytes_per_s": 10.0 * 128.0}
  assert run_figures.bytes_figures(None, 10, 64, 1.0, 2)["bytes_per_token"] is None


# ---- The model on per-node links ----


def test_exchange_times_on_links_of_their_own():
  up, down = [8e6, 4e6, 8e6, 8e6], [8e6, 2e6, 4e6, 8e6]
  assert latency.per_node_exchange_s("group", (0, 3), 1e6, up, down) == pytest.approx(1.0)
  assert latency.per_node_exchange_s("group", (0, 1), 1e6, up, down) == pytest.approx(4.0)  # 1's 2 Mbit/s down
  assert latency.per_node_exchange_s("group", (0, 2, 3), 1e6, up, down) == pytest.approx(4.0)  # 2 copies at 4
  # Ring 0→1→2→3→0, hops at min(up, next's down): 2, 4, 8, 8 Mbit/s; 2·3/4 of 8 Mbit through the slowest.
  assert latency.per_node_exchange_s("ring", (0, 1, 2, 3), 1e6, up, down) == pytest.approx(1.5 * 8 / 2)
  assert latency.per_node_exchange_s("ring", (0,), 1e6, up, down) == 0.0


def test_barrier_schedule_on_links_of_their_own_and_with_the_round_in_flight():
  compute = np.asarray([[2.0, 1.0], [2.0, 1.0]])
  out = latency.barrier_schedule([[[0, 1]]] * 2, compute, exchange_s=lambda g: 0.5)
  assert out["finish"][:, 0].tolist() == [2.5, 5.0] and out["wall_s_per_barrier"] == pytest.approx(2.5)
  assert out["idle_fraction"] == pytest.approx([0.5 / 2.5, 1.5 / 2.5])
  hidden = np.asarray([[1.0, 0.25], [0.0, 0.0]])
  out = latency.barrier_schedule([[[0, 1]]] * 2, compute, exchange_s=lambda g: 0.5, hidden_s=hidden)
  assert out["finish"][0].tolist() == [2.0, 2.25] and out["finish"][1].tolist() == [4.5, 4.5]
  with pytest.raises(ValueError, match="exclude each other"):
    latency.barrier_schedule([[[0, 1]]] * 2, compute, exchange_s=lambda g: 0.5, beta=1.0,
                             bytes_by_group_size=lambda n: 1.0)


def test_the_model_fed_the_measured_steps_uses_the_measured_rounds_groups():
  """The measured step times start after the first round: the model takes the groups of the same rounds and
  leaves nothing more out (it raised with a single measured round, and paired the rounds one off)."""
  args = bench_network.parse(["--step_s=1", "--straggler_factor=2", "--inner_steps=2", "--tau=0"])[1]
  out = {"processes_count": 2, "message_bytes": 8.0, "measured_rounds": 1, "tokens_per_s": 64.0,
         "idle_fraction": [0.0, 0.5], "wait_fraction": [0.0, 0.5],
         "groups": [[[0], [1]], [[0, 1]]]}  # the first (compiling) round alone, the measured one together
  steps = np.asarray([[2.0, 1.0], [2.0, 1.0]])  # one measured round of H = 2: process 0 twice as slow
  model = bench_network.predict("noloco", out, args, None, 0, steps)
  assert model["idle_fraction"] == pytest.approx([0.0, 0.5])  # process 1 waits for its partner: the round's group
  assert model["tokens_per_s"] == pytest.approx(2 * 2 * bench_network.TOKENS_PER_STEP / 4.0)


def test_async_law_with_the_round_in_flight_and_links_of_their_own():
  equal = np.ones((2, 3))
  plain = law.simulate(equal, window_s=0.0, max_wait_s=2.0, exchange_s=0.5)
  assert plain.end_s.tolist() == [4.5, 4.5]  # 1 + 0.5, three times
  overlapped = law.simulate(equal, window_s=0.0, max_wait_s=2.0, exchange_s=0.5, overlap=0.5)
  assert overlapped.end_s.tolist() == [3.5, 3.5]  # each exchange hidden behind half a round
  slow = law.simulate(equal, window_s=0.0, max_wait_s=2.0, exchange_s=0.8, overlap=0.5)
  assert slow.end_s == pytest.approx([4.4, 4.4])  # 0.3 s of each exchange left after the half round
  one = law.simulate(np.ones((4, 1)), window_s=0.01, max_wait_s=2.0, exchange_s=lambda g: 1.0 if 3 in g else 0.1)
  partner = next(g for g in one.batches[0].groups if 3 in g)
  assert [one.end_s[q] for q in range(4)] == pytest.approx([2.0 if q in partner else 1.1 for q in range(4)])
  with pytest.raises(ValueError, match="overlap=1.0"):
    law.simulate(equal, window_s=0.0, max_wait_s=2.0, overlap=1.0)


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


# ---- The benchmark in its seconds-long mode (--quick: P = 2, H = 2, DiLoCo's H = 4, 3 rounds) ----


@pytest.mark.exhaustive(reason="bench_network's quick mode without root (its parts: this file's unit tests; on "
                        "per-node links: the real tier's quick run)")
def test_quick_on_loopback_the_stragglers_partner_idles_and_the_model_says_so(tmp_path):
  """No root: unshaped loopback. With two processes the straggler's (process 0's) only partner waits for it in
  every schedule; the model says half its time; the asynchronous job paired."""
  status, results, err = _quick(tmp_path)
  assert status == 0, err[-3000:]
  assert [r["method"] for r in results["runs"]] == ["diloco", "noloco", "async"]
  for run in results["runs"]:
    idle = run["idle_fraction"]
    assert idle[1] > idle[0] + 0.1, run
    assert run["model"]["idle_fraction"][1] == pytest.approx(0.5, abs=0.05), run["model"]
    assert run["link_mbit"] is None and run["bytes_per_token"] > 0
  assert results["runs"][-1]["skipped_fraction"] < 0.5


# ---- The real links (root; the real-component tier) ----


def _quick(tmp_path, *flags):
  """Runs `bench_network.py --quick FLAGS` as its own program; (exit status, results or None, stderr)."""
  cmd = [sys.executable, os.path.join(REPO, "experiments", "bench_network.py"), "--quick", "--json",
         f"--workdir={tmp_path / 'jobs'}", *flags]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
  lines = done.stdout.strip().splitlines()
  return done.returncode, (json.loads(lines[-1]) if done.returncode == 0 and lines else None), done.stderr


def _processes_naming(text: str) -> list[str]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if text.encode() in f.read():
          found.append(pid)
    except OSError:
      pass
  return found


@pytest.mark.real
@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=f"per-node links {netns.unavailable_reason()}")
def test_quick_on_per_node_links_reports_every_field_and_leaves_nothing(tmp_path):
  status, results, err = _quick(tmp_path, "--links=per_node", "--rate=20mbit")
  assert status == 0, err[-3000:]
  links = results["links"]["2"]
  assert links["control"] == "unshaped" and links["link_mbit"] == [{"up": 20.0, "down": 20.0}] * 2
  for node in links["self_test"]:
    assert node["up_within_tolerance"] and node["down_within_tolerance"], node
  assert [r["method"] for r in results["runs"]] == ["diloco", "noloco", "async"]
  for run in results["runs"]:
    for key in ("method", "schedule", "tau", "codec", "link_mbit", "measured_link_mbit", "idle_fraction",
                "skipped_fraction", "tokens_per_s", "bytes_per_token", "time_to_target_s", "eval_loss_at_budget"):
      assert key in run, key
    assert len(run["idle_fraction"]) == 2 and all(0.0 <= x <= 1.0 for x in run["idle_fraction"])
    # The weights crossed the shaped links: the kernel counted at least the accounted bytes on each.
    sent = [w["sent"] for w in run["wire_bytes"]]
    assert all(b >= 0.9 * run["bytes_per_run"] for b in sent), (sent, run["bytes_per_run"])
    assert run["model"] is not None and run["tokens_per_s"] > 0
  assert results["runs"][0]["time_to_target_s"] == results["runs"][0]["budget_s"]  # DiLoCo sets the target
  assert _processes_naming(str(tmp_path)) == []  # every job process is gone (and the namespaces with them)


@pytest.mark.real
@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=f"per-node links {netns.unavailable_reason()}")
def test_a_rate_tc_refuses_is_one_line_naming_the_flag(tmp_path):
  status, _, err = _quick(tmp_path, "--links=per_node", "--rate=4bit")
  assert status == 2 and len(err.strip().splitlines()) == 1 and "--rate=4bit: tc refuses" in err, err


def test_results_of_the_first_benchmark_are_replotted_as_before(tmp_path, capsys):
  """RESULTS.md's older sections re-plot their saved JSON (no "version": 2) with that benchmark's own model."""
  saved = os.path.join(REPO, "experiments", "results_bench_network_async_p8_wait02.json")
  out = bench_network.main(["--plot_from", saved, "--table", "--plot", str(tmp_path / "idle.png")])
  assert out["runs"] and all("model" in r for r in out["runs"] if r["method"] != "async")
  assert "| setting | P | method | wall s / round" in capsys.readouterr().out and (tmp_path / "idle.png").exists()


def test_saved_per_node_results_are_tabled_with_the_codec_each_method_sent(tmp_path, capsys):
  """RESULTS.md's per-node figures re-plot from their JSON; DiLoCo's all-reduce carried float32 although that
  run asked for bfloat16 (its round reads no codec), and the table says what was sent."""
  saved = os.path.join(REPO, "experiments", "results_bench_network_p8_hetero.json")
  out = bench_network.main(["--plot_from", saved, "--table", "--plot_loss", str(tmp_path / "loss.png")])
  assert [r["method"] for r in out["runs"]] == list(bench_network.METHODS) and (tmp_path / "loss.png").exists()
  text = capsys.readouterr().out
  assert "| diloco | 0 | float32 |" in text and "| async | 8 | bfloat16 |" in text
