"""Evaluation: every `eval_every` steps and at the last step, the validation loss of every replica.

An evaluation is a job-wide barrier (the per-replica losses are gathered over all processes), so it
runs at a barrier step: the round driver has settled (an overlapped exchange is waited for, θ is
evaluated as it is, unmerged) and every process's training rows up to the step have been written,
which `run.flush_logs()` merges before the evaluation row, so metrics.jsonl stays in step order.
"""

from __future__ import annotations

import jax
import numpy as np

from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.training.plugins import dispatch
from noloco_jax.training.plugins.base import Plugin


def evaluate(setup, state, eval_batches: jax.Array) -> dict[str, float]:
  """eval/loss = mean over replicas of each replica's mean validation loss; eval/ppl = exp of it."""
  losses = []
  for i in range(eval_batches.shape[0]):
    losses.append(setup.eval_step(state.params, eval_batches[i]))
    if (i + 1) % dispatch.EVAL_CHUNK == 0:  # bounded run-ahead: see training/plugins/dispatch.py
      jax.block_until_ready(losses[-1])
  losses = mesh_lib.fetch(losses)  # per-replica losses live on every process: one all-gather
  per_replica = np.mean(np.stack([np.asarray(x) for x in losses]), axis=0)
  loss = float(np.mean(per_replica))
  return {"eval/loss": loss, "eval/ppl": float(np.exp(loss)),
          "replicas/weight_std": float(setup.weight_std(state.params))}


class Evaluation(Plugin):
  name = "eval"

  def start(self, run) -> None:
    if not run.loop.resumed:
      self._evaluate(run, 0)  # step 0: the untrained baseline

  def barrier_due(self, run, step: int) -> bool:
    every = run.config.eval_every
    return bool(every and step % every == 0) or step == run.config.num_steps

  def at_barrier(self, run, step: int) -> None:
    self._evaluate(run, step)
    run.rate.restart()  # keep evaluation out of the steps/s figure

  def _evaluate(self, run, step: int) -> None:
    scalars = evaluate(run.setup, run.state, run.eval_batches)  # a barrier: every row up to `step` is written
    run.flush_logs()  # so process 0 merges them before the evaluation row
    run.writer.write_scalars(step, scalars)
    run.loop.history["eval"].append({"step": step, **scalars})
