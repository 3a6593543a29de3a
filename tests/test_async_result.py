"""The asynchronous job's own result (noloco_jax/asynchronous/result.py): the consensus model's weights
against a NumPy reference of the method's staleness weighting, a process's progress from its checkpoint
record, and the job read as one run of P replicas. The whole path on real processes (the job's summary
against the lock-step job's, export_hf, sample and report on the job's workdir) is in
tests/test_async_driver.py."""

import math

import jax
import ml_collections
import numpy as np
import pytest

from noloco_jax.asynchronous import result
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.outer import consensus as consensus_lib


def _snapshot(step, theta, phi, progress=None):
  meta = {"history": {}} if progress is None else {"history": {"async": {"progress": progress, "progress_step": step - 2}}}
  return read_lib.Snapshot(workdir="w", step=step, config=None, params={"w": theta[None]}, slow={"w": phi[None]},
                           meta=meta)


def _job(snaps, *, inner_steps=3, decay=0.693):
  config = ml_collections.ConfigDict({"num_replicas": len(snaps), "outer": {"inner_steps": inner_steps,
                                                                             "asynchronous": {"staleness_decay": decay}}})
  return result.JobSnapshot(workdir="w", slots=tuple(range(len(snaps))), snapshots=tuple(snaps), config=config)


def test_progress_is_the_drivers_record_advanced_by_the_steps_since():
  assert result.progress(_snapshot(12, np.zeros(2), np.zeros(2), progress=7.5)) == 9.5  # 7.5 set at step 10
  assert result.progress(_snapshot(12, np.zeros(2), np.zeros(2))) == 12.0  # no record: its own steps


def test_the_consensus_weighs_each_process_as_the_method_weighs_a_message():
  rng = np.random.default_rng(0)
  thetas, phis = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
  progress = [12.0, 9.0, 3.0]  # 0, 1 and 3 rounds behind the front-runner at H = 3
  job = _job([_snapshot(12, t, p, progress=s - 2) for t, p, s in zip(thetas, phis, progress)])  # set 2 steps ago
  assert job.progress == progress
  q = np.exp(-0.693 * np.array([0.0, 1.0, 3.0]))  # q_k = exp(−λ · lag_k), lag in rounds (outer/async_rules.py)
  np.testing.assert_allclose(job.consensus_weights(), q, rtol=1e-6)
  want = (q[:, None] * phis.astype(np.float64)).sum(0) / q.sum()
  np.testing.assert_allclose(job.weights(consensus=True)["w"], want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(job.weights(consensus=True, source="theta")["w"],
                             (q[:, None] * thetas.astype(np.float64)).sum(0) / q.sum(), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(job.weights(replica=1)["w"], thetas[1])
  with pytest.raises(read_lib.CheckpointReadError, match=r"--replica=3: the asynchronous job in w has processes \[0, 1, 2\]"):
    job.weights(replica=3)


def test_at_equal_progress_the_consensus_is_the_lockstep_consensus_bit_for_bit():
  rng = np.random.default_rng(1)
  phis = rng.normal(size=(4, 7)).astype(np.float32)
  job = _job([_snapshot(12, np.zeros(7, np.float32), p, progress=10.0) for p in phis])
  want = consensus_lib.consensus_params({"w": np.zeros((4, 7), np.float32)}, {"w": phis})
  np.testing.assert_array_equal(job.weights(consensus=True)["w"], np.asarray(want["w"]))
  assert job.params["w"].shape == (4, 7) and job.step == 12 and job.describe().startswith("process 0 step 12")


def test_the_weighted_mean_keeps_the_models_dtype():
  x = np.arange(6, dtype=np.float32).reshape(3, 2)
  like = {"w": np.zeros(2, jax.numpy.bfloat16)}
  out = result.weighted_mean({"w": x}, [1.0, 1.0, 2.0], like)
  assert out["w"].dtype == like["w"].dtype
  np.testing.assert_allclose(out["w"].astype(np.float32), [(0 + 2 + 8) / 4, (1 + 3 + 10) / 4], rtol=1e-2)
  assert math.isclose(float(np.asarray(result.weighted_mean({"w": x}, [1, 0, 0], {"w": x[0]})["w"][1])), 1.0)
