"""The consensus model's validation loss at every evaluation, as a plug-in of the training loop.

`eval/loss` is the mean over replicas of each replica's own loss. The model a user ships is the average
of the replicas (outer/consensus.py: the mean of φ, or of θ). This plug-in scores that average on the
same validation batches at every evaluation step and logs `eval/consensus_loss` and
`eval/consensus_ppl`, so the cost (or gain) of not averaging is a number in every run:
eval/consensus_loss − eval/loss.

A plug-in (training/plugins/base.py), registered after the evaluation plug-in when config.eval_consensus
names a source (`slow`, the default: the mean of φ; `theta`: of θ; methods without φ use θ):
  start(run)             compiles the consensus loss; on a fresh run, the step-0 baseline
  at_barrier(run, step)  at evaluation steps (eval_every, the last step): the consensus loss, its own row
What it reads from `run`: run.setup (config, model, mesh), run.state (the replica-stacked TrainState),
run.eval_batches ([E, B, L+1] replicated on the mesh) and run.writer (a MetricWriter).

Collectives: the mean over the replica axis of a [N, ...] leaf sharded over `replica` is one
all-reduce per leaf (XLA inserts it inside the jit); every process must call it at the same step,
hence `at_barrier` and never `after_step`. Its result, one model, is replicated on every device, and
its evaluation runs on each device whole, the same E batches (1/N of the replicas' evaluation work).
"""

from __future__ import annotations

import math

import jax

from noloco_jax.outer import consensus
from noloco_jax.training.plugins.base import Plugin


class ConsensusEval(Plugin):
  """Logs the consensus model's validation loss at every evaluation (eval_every and the last step)."""

  name = "consensus"

  def __init__(self, source: str = "slow"):
    if source not in consensus.SOURCES:
      raise ValueError(f"consensus source={source!r}; valid: {', '.join(consensus.SOURCES)}.")
    self.source = source
    self._loss = None
    self._config = None

  def start(self, run) -> None:
    self._config = run.setup.config
    model, source = run.setup.model, self.source

    def loss(params, outer, batches):
      slow = outer.get("slow") if isinstance(outer, dict) else None  # ddp and none keep no φ
      return consensus.consensus_loss(model.loss, consensus.consensus_params(params, slow, source), batches)

    # Replicated output: the all-reduce of the mean is the only collective (see the module docstring).
    self._loss = jax.jit(loss, out_shardings=jax.sharding.NamedSharding(run.setup.mesh, jax.sharding.PartitionSpec()))
    if not run.loop.resumed:  # step 0: the untrained baseline, beside the evaluation plug-in's
      self.at_barrier(run, 0)

  def due(self, step: int) -> bool:
    every, last = self._config.eval_every, self._config.num_steps
    return step == 0 or step == last or bool(every and step % every == 0)

  def evaluate(self, run) -> dict[str, float]:
    """{"eval/consensus_loss", "eval/consensus_ppl"} of the current state."""
    loss = float(self._loss(run.state.params, run.state.outer, run.eval_batches))
    return {"eval/consensus_loss": loss, "eval/consensus_ppl": math.exp(loss) if loss < 700 else float("inf")}

  def barrier_due(self, run, step: int) -> bool:
    return self.due(step)

  def at_barrier(self, run, step: int) -> None:
    if self.due(step):
      scalars = self.evaluate(run)
      run.writer.write_scalars(step, scalars)
      if run.loop.history["eval"] and run.loop.history["eval"][-1]["step"] == step:
        run.loop.history["eval"][-1].update(scalars)  # beside eval/loss in the summary's history
