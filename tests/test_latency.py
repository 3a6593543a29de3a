"""NumPy reference checks of experiments/lib/latency.py and experiments/latency_model.py (fast; JAX only for the model sizes)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments.lib import latency


# ---- Constant message times ----


@pytest.mark.parametrize("n", [2, 4, 64, 1024, 4096])
def test_tree_constant_is_2_t_log2_n(n):
  assert latency.tree_allreduce_time_constant(n, t=0.3) == pytest.approx(2 * 0.3 * math.log2(n))
  assert latency.ring_allreduce_time_constant(n, t=0.3) == pytest.approx(2 * 0.3 * (n - 1))


def test_constant_speedup_at_1024_is_exactly_10():
  assert latency.constant_speedup(1024) == 10.0
  assert latency.tree_allreduce_time_constant(2) == latency.pair_exchange_time_constant()


def test_monte_carlo_with_zero_spread_reproduces_the_closed_forms():
  for n in (2, 8, 256):
    tree = latency.simulate_tree_allreduce(n, std=0.0, trials=3, seed=0, mean=0.5)
    np.testing.assert_allclose(tree, latency.tree_allreduce_time_constant(n, 0.5))
    ring = latency.simulate_ring_allreduce(n, std=0.0, trials=2, seed=0, mean=0.5)
    np.testing.assert_allclose(ring, latency.ring_allreduce_time_constant(n, 0.5))
  np.testing.assert_allclose(latency.simulate_pair_exchange(0.0, 5, 0), 2.0)
  np.testing.assert_allclose(latency.simulate_pair_exchange(0.0, 5, 0, variant="relay"), 2.0)
  np.testing.assert_allclose(latency.simulate_pair_exchange(0.0, 5, 0, variant="swap"), 1.0)


def test_tree_rejects_non_powers_of_two():
  with pytest.raises(ValueError):
    latency.tree_allreduce_time_constant(12)


# ---- Log-normal message times ----


def test_lognormal_has_requested_mean_and_std():
  # std/mean = 0.5: light enough tails for a tight check with 10^6 seeded draws.
  x = latency.sample_lognormal(np.random.default_rng(0), 2.0, 1.0, 1_000_000)
  assert x.mean() == pytest.approx(2.0, rel=3e-3)
  assert x.std() == pytest.approx(1.0, rel=1e-2)
  # std/mean = 2.5 (the paper's case) has heavy tails: check the mean loosely and the exact parameters.
  y = latency.sample_lognormal(np.random.default_rng(1), 1.0, 2.5, 2_000_000)
  assert y.mean() == pytest.approx(1.0, rel=0.02)
  mu, sigma = latency.lognormal_params(1.0, 2.5)
  assert math.exp(mu + sigma ** 2 / 2) == pytest.approx(1.0)
  assert math.sqrt((math.exp(sigma ** 2) - 1) * math.exp(2 * mu + sigma ** 2)) == pytest.approx(2.5)


def test_monte_carlo_is_reproducible_from_the_seed():
  a = latency.simulate_tree_allreduce(64, 2.5, 50, seed=(3, 64))
  b = latency.simulate_tree_allreduce(64, 2.5, 50, seed=(3, 64))
  c = latency.simulate_tree_allreduce(64, 2.5, 50, seed=(4, 64))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  r1 = latency.simulate_barrier_coupled(32, 10, 0.5, rounds=6, trials=2, seed=5)
  r2 = latency.simulate_barrier_coupled(32, 10, 0.5, rounds=6, trials=2, seed=5)
  assert r1 == r2


def test_pair_is_the_tree_at_n_equal_2_in_distribution():
  tree2 = latency.simulate_tree_allreduce(2, 0.5, 200_000, seed=1)
  pair = latency.simulate_pair_exchange(0.5, 200_000, seed=2)
  assert tree2.mean() == pytest.approx(pair.mean(), rel=0.01)


def test_lognormal_tree_grows_faster_than_constant():
  t1024 = latency.simulate_tree_allreduce(1024, 2.5, 200, seed=0).mean()
  pair = latency.simulate_pair_exchange(2.5, 100_000, seed=0).mean()
  assert t1024 / pair > 2 * latency.constant_speedup(1024)


# ---- Barrier ----


def test_barrier_extra_is_nonnegative_and_grows_with_n():
  w = latency.simulate_round_compute_times(1024, 100, 0.5, trials=10, seed=0)
  extras = latency.barrier_extra_by_n(w, [2, 16, 1024])
  assert extras[0] == 0.0  # one pair: the global barrier is the pair's
  assert all(e >= 0 for e in extras)
  assert extras[0] < extras[1] < extras[2]
  coupled = latency.simulate_barrier_coupled(256, 20, 0.5, rounds=16, trials=2, seed=0)
  assert coupled["extra"] >= 0
  # The coupled NoLoCo round lies between max-of-2 and max-of-N.
  w256 = latency.simulate_round_compute_times(256, 20, 0.5, trials=20, seed=1)
  dec = latency.barrier_extra_decoupled(w256)
  assert dec["noloco_round"] < coupled["noloco_round"] < dec["diloco_round"]


# ---- α–β model and sizes ----


def test_alpha_beta_formulas_on_hand_computed_numbers():
  # P = 8, S = 1000 bytes, α = 1 s, β = 0.01 s/byte (S·β = 10 s).
  assert latency.ring_allreduce_alpha_beta(8, 1000, 1.0, 0.01) == pytest.approx(14 + 17.5)
  assert latency.tree_allreduce_alpha_beta(8, 1000, 1.0, 0.01) == pytest.approx(6 * 11)
  assert latency.pair_exchange_alpha_beta(1000, 1.0, 0.01) == pytest.approx(11)
  assert latency.pair_exchange_reference_alpha_beta(1000, 1.0, 0.01) == pytest.approx(2 * 21)
  assert latency.seconds_per_byte(1e9) == pytest.approx(8e-9)
  assert latency.bytes_sent_per_replica_per_round("ring", 4, 100) == pytest.approx(150)


def test_small_model_parameter_count_by_hand():
  embed_and_head = 128_002 * 768 * 2  # 196,611,072
  per_layer = 4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768  # 9,438,720
  assert embed_and_head == 196_611_072 and per_layer == 9_438_720
  # Vocabulary 128,002, d 768, 12 layers, MLP 3072; the count comes from models/llama.py's interface.
  assert latency.paper_model_params("small") == 196_611_072 + 12 * 9_438_720 + 768 == 309_876_480
  assert round(latency.paper_model_params("medium") / 1e9, 2) == 2.14
  assert round(latency.paper_model_params("large") / 1e9, 2) == 9.64
  assert latency.model_bytes(10, "bfloat16") == 20 and latency.model_bytes(10, "float32") == 40


# ---- The script ----


def test_script_json_output_parses_and_has_the_keys():
  cmd = [sys.executable, os.path.join(REPO, "experiments", "latency_model.py"), "--json",
         "--trials", "50", "--ring-trials", "1", "--ring-max-n", "64", "--cv-sweep", "0.5", "1.0",
         "--barrier-trials", "2", "--barrier-rounds", "6", "--barrier-coupled-trials", "1",
         "--h", "10"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  for key in ("headline", "constant", "lognormal", "barrier", "alpha_beta", "params"):
    assert key in result
  head = result["headline"]
  for key in ("key_n", "constant_speedup", "lognormal_ratio", "barrier_extra_decoupled",
              "barrier_extra_coupled", "params_small", "params_medium", "params_large"):
    assert key in head
  assert head["key_n"] == 1024 and head["constant_speedup"] == 10.0
  assert head["params_small"] == 309_876_480
  assert len(result["alpha_beta"]["rows"]) == 3 * 2 * 2 * 3  # models × dtypes × links × N


# ---- Section 8: barriers on one setting (experiments/lib/barrier_sim.py), the benchmark's model ----


def test_barrier_schedule_carries_the_lag_to_the_next_partner():
  groups = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]]
  compute = latency.per_barrier(latency.straggler_step_times(4, 6, 0.5, 2.0), 2)  # [[2, 1, 1, 1]] × 3
  np.testing.assert_allclose(compute, [[2.0, 1.0, 1.0, 1.0]] * 3)
  # Barrier 0 (clocks only): finish [2, 2, 1, 1]. Barrier 1: ready [4, 3, 2, 2]; 0+2 end at 4 (2 waits
  # 2), 1+3 at 3 (3 waits 1). Barrier 2: ready [6, 4, 5, 4]; 0+3 end at 6 (3 waits 2), 1+2 at 5 (1 waits 1).
  out = latency.barrier_schedule(groups, compute)
  np.testing.assert_allclose(out["finish"], [[2, 2, 1, 1], [4, 3, 4, 3], [6, 5, 5, 6]])
  np.testing.assert_allclose(out["idle_fraction"], [0.0, 1 / 3, 2 / 4, 3 / 5])
  # The slowest process over the counted barriers: process 3, from 1 to 6 (it caught the lag), / 2.
  assert out["wall_s_per_barrier"] == pytest.approx(2.5)
  everyone = [[[0, 1, 2, 3]]] * 3  # the global barrier: every fast process idles half the time
  np.testing.assert_allclose(latency.barrier_schedule(everyone, compute)["idle_fraction"], [0, .5, .5, .5])


def test_barrier_schedule_alpha_and_a_shared_fifo_link():
  groups = [[[0, 1], [2, 3]]] * 2
  compute = np.array([[1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
  # α only: every exchange 0.5 s, no queueing. Finish [1.5, 1.5, 3.5, 3.5], then [3, 3, 5, 5].
  out = latency.barrier_schedule(groups, compute, alpha=0.5, first=0)
  np.testing.assert_allclose(out["finish"], [[1.5, 1.5, 3.5, 3.5], [3.0, 3.0, 5.0, 5.0]])
  np.testing.assert_allclose(out["idle_fraction"], [1 / 3, 1 / 3, 1 / 5, 1 / 5])  # (2 × 0.5) / (compute + 1)
  # A shared link of 1 s per byte, 2 bytes per pair (α = 0). Barrier 0: pair 01 ready at 1, sends
  # until 3; pair 23 ready at 3, sends until 5. Barrier 1: 01 ready at 4, link free at 5 -> queues,
  # ends at 7; 23 ready at 6, link free at 7 -> ends at 9.
  out = latency.barrier_schedule(groups, compute, beta=1.0, bytes_by_group_size=lambda n: 2.0, first=0)
  np.testing.assert_allclose(out["finish"], [[3, 3, 5, 5], [7, 7, 9, 9]])
  assert out["wall_s_per_barrier"] == pytest.approx(4.5)
  # A bucket of 1.5 bytes, full at 0; the link serves groups in the order they are ready. 01 at 1:
  # 1.5 tokens, waits for 0.5 byte, ends at 1.5 (bucket empty). 01 again at 2.5 (before 23's first at
  # 3): 1 token refilled, ends at 3.5. 23 at 3: the link is busy until 3.5, no tokens: ends at 5.5.
  # 23 again at 6.5: 1 token, ends at 7.5.
  out = latency.barrier_schedule(groups, compute, beta=1.0, bytes_by_group_size=lambda n: 2.0, burst_bytes=1.5,
                                 first=0)
  np.testing.assert_allclose(out["finish"], [[1.5, 1.5, 5.5, 5.5], [3.5, 3.5, 7.5, 7.5]])


def test_link_bytes_of_a_pair_and_a_ring():
  assert latency.link_bytes("pair", 2, 100.0) == 200.0
  assert latency.link_bytes("ring", 8, 100.0) == pytest.approx(2 * 7 * 100.0)


def test_lognormal_step_times_are_the_fault_injectors_draws():
  from noloco_jax.runtime import faults  # pylint: disable=g-import-not-at-top
  times = latency.lognormal_step_times(3, 20, 0.05, 0.5, seed=4)
  for p in range(3):
    injector = faults.Injector(faults.parse("lognormal:median=0.05,sigma=0.5,seed=4"), p)
    np.testing.assert_allclose(times[:, p], [injector.delay_after(s, 0.0) for s in range(1, 21)], rtol=1e-12)


@pytest.mark.parametrize("kwargs,message", [({"first": 3}, "first=3"), ({"beta": 1.0}, "bytes_by_group_size")])
def test_barrier_schedule_refuses_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    latency.barrier_schedule([[[0, 1]]] * 3, np.ones((3, 2)), **kwargs)
  with pytest.raises(ValueError, match="do not cover"):
    latency.barrier_schedule([[[0]]] * 3, np.ones((3, 2)))


def test_async_schedule_on_hand_computed_settings():
  # Two processes, rounds of one step: process 0 2 s, process 1 1 s. Each round process 1 waits 1 s for its
  # only partner (the budget is 10 s); process 0 never waits. 4 rounds each, the last ends at 8 s.
  out = latency.async_schedule(latency.straggler_step_times(2, 4, 1.0, 2.0), 1, window_s=0.0, max_wait_s=10.0)
  np.testing.assert_allclose(out["idle_fraction"], [0.0, 0.5])
  assert out["rounds"] == [4, 4] and out["skips"] == [0, 0] and out["steps_per_s"] == pytest.approx(8 / 8.0)
  # Four processes at one speed: every round (two steps of 1 s) all four are ready at once and pair at once;
  # an exchange of 0.25 s is all they idle (0.25 of every 2.25 s).
  out = latency.async_schedule(np.ones((6, 4)), 2, window_s=0.0, max_wait_s=1.0, exchange_s=0.25)
  np.testing.assert_allclose(out["idle_fraction"], [1 / 9] * 4)
  # A budget shorter than the straggler's lag: process 1 gives up after 0.5 s and trains on alone.
  out = latency.async_schedule(latency.straggler_step_times(2, 4, 1.0, 2.0), 1, window_s=0.0, max_wait_s=0.5)
  assert out["skips"][1] > 0
