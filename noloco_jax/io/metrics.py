"""Metric definitions and writers. One name per metric, the same in TensorBoard, metrics.jsonl and notebooks.

Names: train/loss, train/grad_norm, eval/loss, eval/ppl, replicas/weight_std,
outer/pseudo_grad_norm, outer/round, comm/bytes_sent_per_replica, comm/bytes_received_per_replica
(cumulative, on the wire), comm/collective_operand_bytes_per_replica (cumulative; all three defined in
noloco_jax/outer/wire.py), perf/steps_per_s,
perf/tokens_per_s, model/num_params (logged once, per replica), outer/skipped_rounds (cumulative;
only with nan_policy="skip_round").
The writers themselves (TensorBoard, JSON lines, log, Weights & Biases) are in writers.py.
"""

from __future__ import annotations

import json
import os

from clu import parameter_overview  # the parameter table; imports no TensorFlow (clu.metric_writers would)
import jax
import jax.numpy as jnp

from noloco_jax.io import writers


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


def parameter_table(params_NxP) -> str:
  """The parameter table of one replica (names, shapes, dtypes, sizes, the total), as flax's examples log it
  at start: clu.parameter_overview, on shapes only (nothing is read from the devices). clu's metric writers
  are not used: they import TensorFlow (io/writers.py writes TensorBoard's files without it)."""
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params_NxP)
  return parameter_overview.get_parameter_overview(one, include_stats=False)


def make_writer(workdir: str, wandb_cfg=None, run_config: dict | None = None) -> writers.MetricWriter:
  """TensorBoard events + metrics.jsonl + log lines on process 0 (and W&B when config.wandb (`wandb_cfg`)
  names a project: the run's config, `run_config`, goes with it); log lines only on the others."""
  if jax.process_index() != 0:
    return writers.LoggingWriter()
  chosen = [writers.LoggingWriter(), writers.TensorBoardWriter(workdir),
            writers.JsonlWriter(os.path.join(workdir, "metrics.jsonl"))]
  if wandb_cfg is not None and wandb_cfg.project and wandb_cfg.mode != "disabled":
    chosen.append(writers.WandbWriter(workdir, wandb_cfg, run_config or {}))
  return writers.MultiWriter(chosen)


def read_jsonl(path: str, *, missing_ok: bool = False, skip_damaged: bool = False) -> list[dict]:
  """The rows of a JSONL log. `missing_ok`: no file (yet) is no rows. `skip_damaged`: a line that is not
  JSON is left out instead of raising — the last line of a log being written, or one cut by a crash
  (the rows before and after it stand)."""
  if missing_ok and not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        if not skip_damaged:
          raise
  return rows
