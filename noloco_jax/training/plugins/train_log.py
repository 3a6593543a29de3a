"""Training rows: every `log_every` steps, the mean training metrics since the last row.

Two ways, chosen once (config.log_barrier, training/plugins/__init__.py):

- job-wide (one process, or log_barrier=True): a log step is a barrier; every replica's metrics are
  gathered (one all-gather per log interval, never per step) and the row goes to metrics.jsonl; the
  cross-replica weight std is taken after every round's update (an all-reduce, so also at a barrier);
- per process (several processes, log_barrier=False): nothing between two evaluations waits for another
  process except the outer round's own exchange with partners. Each process reads only its own
  replicas' metrics (no collective) and appends its row to workdir/metrics/process_<i>.jsonl; process 0
  merges the rows that have arrived into metrics.jsonl (io/process_metrics.py). The per-round weight
  std (an all-reduce over every replica) is left to evaluations.

With nan_policy="error" the fetched losses are checked here: a NaN stops the run naming the step and
the replica (on this process; in a multi-process job the others then stop through distributed.py).
"""

from __future__ import annotations

from typing import Any

from absl import logging
import jax
import numpy as np

from noloco_jax.io import checkpoint as checkpoint_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.io import process_metrics
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.training.plugins.base import Plugin


class TrainLog(Plugin):
  name = "log"

  def __init__(self, *, job_wide: bool):
    self.job_wide = job_wide
    self._plog = None

  def start(self, run) -> None:
    config = run.config
    self._local_ids = mesh_lib.local_replica_ids(run.setup.mesh, config.num_replicas)
    self._plog = process_metrics.ProcessLog(run.workdir, run.writer, len(self._local_ids), start_step=run.loop.step)
    run.on_exit(lambda failed: self._plog.close())
    if not run.loop.resumed:
      run.writer.write_scalars(0, {"model/num_params": run.setup.model.num_params()})
    if jax.process_index() == 0:  # what the model is, at every start (io/metrics.py: clu's parameter overview)
      logging.info("Parameters of one replica (the state holds %d, stacked on a leading replica axis):\n%s",
                   config.num_replicas, metrics_lib.parameter_table(run.state.params))

  def _log_step(self, run, step: int) -> bool:
    return step % max(run.config.log_every, 1) == 0 or step == run.config.num_steps

  def after_step(self, run, step: int, metrics: dict) -> None:
    if not self.job_wide and self._log_step(run, step):
      self._plog.write_train(step, self._scalars(run, step, self._local_ids))

  def barrier_due(self, run, step: int) -> bool:
    return self.job_wide and (self._log_step(run, step) or run.loop.round_applied_at == step)

  def at_barrier(self, run, step: int) -> None:
    if not self.job_wide:
      return
    if run.loop.round_applied_at == step:  # the spread right after the round's update
      run.loop.set_round_weight_std(run.setup.weight_std(run.state.params))
    if self._log_step(run, step):
      scalars = self._scalars(run, step, None)
      (run.writer.write_scalars if run.config.log_barrier else self._plog.write_train)(step, scalars)

  def flush(self, run) -> None:
    if self._plog is not None:
      self._plog.sync()  # process 0 merges every process's rows that have arrived

  def end(self, run) -> None:
    self._plog.close()  # process 0 merges the rows that have arrived (all of them after the final barrier)

  def _scalars(self, run, step: int, local_ids) -> dict[str, Any]:
    """The log step's training scalars, from the metrics pending since the last log (then cleared).

    local_ids None: every replica, by one gather for the whole interval (a collective over all processes
    in a multi-process job). Else only these replicas, read from this process's shards.
    """
    config, loop = run.config, run.loop
    steps, metrics, rounds = loop.take_pending()
    if local_ids is None:
      metrics, rounds = mesh_lib.fetch((metrics, rounds))
    else:
      metrics, rounds = process_metrics.local_fetch((metrics, rounds), local_ids, config.num_replicas)
    losses = np.stack([np.asarray(m["loss"]) for m in metrics])
    if config.nan_policy == "error":
      checkpoint_lib.check_finite(losses, steps, local_ids)
    scalars = {
        "train/loss": float(losses.mean()),
        "train/grad_norm": float(np.mean([np.asarray(m["grad_norm"]) for m in metrics])),
        # Cumulative, per replica (outer/wire.py): on the wire under outer.rule.allreduce_algorithm, and the
        # compiled collectives' operands.
        "comm/bytes_sent_per_replica": loop.bytes_sent,
        "comm/bytes_received_per_replica": loop.bytes_received,
        "comm/collective_operand_bytes_per_replica": loop.comm_bytes,
        "outer/round": loop.round,
        **run.rate.since_last_log(step),
    }
    # The round schedule's own cumulative counters, if it keeps any (the asynchronous schedule's exchanged,
    # skipped and failed rounds, its waits: training/rounds/asynchronous.py).
    if run.driver is not None:
      scalars.update(run.driver.scalars())
    if config.nan_policy == "skip_round":
      scalars["outer/skipped_rounds"] = len(loop.history.get("skipped_rounds", []))
    if rounds:
      scalars["outer/pseudo_grad_norm"] = float(np.mean([np.asarray(m["pseudo_grad_norm"]) for m, _ in rounds]))
      if rounds[-1][1] is not None:  # None: not computed (a global all-reduce; see log_barrier)
        scalars["replicas/weight_std"] = float(rounds[-1][1])
    loop.history["train"] = scalars
    return scalars
