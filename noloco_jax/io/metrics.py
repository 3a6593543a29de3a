"""Metric definitions and writers. One name per metric, the same in TensorBoard, metrics.jsonl and notebooks.

Names: train/loss, train/grad_norm, eval/loss, eval/ppl, replicas/weight_std,
outer/pseudo_grad_norm, outer/round, comm/bytes_per_replica (cumulative), perf/steps_per_s,
perf/tokens_per_s, model/num_params (logged once, per replica).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from clu import metric_writers


def weight_std(params_NxP) -> jax.Array:
  """The paper's cross-replica spread: sqrt(Σ (p − mean_r p)² / (N · #params)) over all leaves.

  A diagnostic, not part of training: XLA turns the mean over the sharded replica axis into one
  all-reduce, which is acceptable at evaluation time and never happens inside a round.

  With pipeline stages the params keep their logical [N, ...] shapes (each parameter stored on one
  stage, pipeline.py), so these sums already run over all stages, replicas and parameters, and
  #params is the whole model's: the paper's definition, with no per-stage code here.
  """
  leaves = jax.tree.leaves(params_NxP)
  n = leaves[0].shape[0]
  count = sum(x[0].size for x in leaves)

  def squared_deviation(x):
    # Shift by replica 0 first: identical replicas then give exactly 0 (a float mean of N equal values
    # need not equal them), and the subtraction loses less precision when the spread is tiny.
    d = x.astype(jnp.float32) - x[:1].astype(jnp.float32)
    return jnp.sum(jnp.square(d - jnp.mean(d, axis=0)))

  return jnp.sqrt(sum(squared_deviation(x) for x in leaves) / (n * count))


def weight_std_numpy(params_NxP) -> float:
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params_NxP)]
  n, count = leaves[0].shape[0], sum(x[0].size for x in leaves)
  return float(np.sqrt(sum(((x - x.mean(0)) ** 2).sum() for x in leaves) / (n * count)))


class JsonlWriter(metric_writers.interface.MetricWriter):
  """Appends one JSON object per write to `path`: {"step": s, name: value, ...}."""

  def __init__(self, path: str):
    self._file = open(path, "a", buffering=1)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {"step": int(step)}
    for key, value in scalars.items():
      value = float(np.asarray(value))
      row[key] = value if math.isfinite(value) else str(value)
    self._file.write(json.dumps(row) + "\n")

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def make_writer(workdir: str) -> metric_writers.MetricWriter:
  """TensorBoard + metrics.jsonl on process 0; log lines only on the others."""
  if jax.process_index() != 0:
    return metric_writers.create_default_writer(workdir, just_logging=True)
  return metric_writers.MultiWriter([
      metric_writers.create_default_writer(workdir, asynchronous=False),
      JsonlWriter(os.path.join(workdir, "metrics.jsonl")),
  ])


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
