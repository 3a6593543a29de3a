"""experiments/bench_network.py: its summaries of step traces and the straggler model, on synthetic traces.

(The benchmark's processes themselves take minutes on a loaded 2-core machine; the trace format it
reads is the one training/faults.py writes, exercised by tests/test_no_barrier.py's job.)
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import bench_network  # noqa: E402


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
         "last_row": {"comm/bytes_per_replica": 1234.0}}
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


def test_straggler_model():
  assert bench_network.model_idle("diloco", 4, 2.0, [1.0] * 4) == [0.0, 0.5, 0.5, 0.5]
  groups = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 2], [1, 3]], [[3, 0], [1, 2]]]  # round 0 left out
  share = bench_network.paired_share(groups, 4)
  np.testing.assert_allclose(share, [1.0, 0.0, 2 / 3, 1 / 3])
  np.testing.assert_allclose(bench_network.model_idle("noloco", 4, 2.0, share), [0.0, 0.0, 1 / 3, 1 / 6])


def test_pair_barrier_model_carries_the_lag_to_the_next_partner():
  groups = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]]
  # Round 0 (clocks only): finish = [2, 2, 1, 1]. Round 1: ready [4, 3, 2, 2]; 0+2 end at 4 (2 waits 2),
  # 1+3 at 3 (3 waits 1). Round 2: ready [6, 4, 5, 4]; 0+3 end at 6 (3 waits 2), 1+2 at 5 (1 waits 1).
  # Waits 1, 2, 3 over 2 units of compute each.
  idle = bench_network.pair_barrier_idle(groups, [2.0, 1.0, 1.0, 1.0])
  np.testing.assert_allclose(idle, [0.0, 1 / 3, 2 / 4, 3 / 5])
  everyone = [[[0, 1, 2, 3]]] * 3  # the global barrier: every fast process idles half the time
  np.testing.assert_allclose(bench_network.pair_barrier_idle(everyone, [2.0, 1.0, 1.0, 1.0]), [0, .5, .5, .5])
