"""Plug-ins: the optional work around the loop, each behind the interface of base.py.

`from_config(run)` is the one place that turns them on, in the order they run. Removing a feature is
deleting its module and its line here.
"""

from __future__ import annotations

import jax

from noloco_jax.training.plugins.base import Plugin, Plugins
from noloco_jax.config.run import parse_steps
from noloco_jax.training.plugins.checkpointing import Checkpointing
from noloco_jax.training.plugins.consensus_eval import ConsensusEval
from noloco_jax.training.plugins.evaluation import Evaluation, evaluate
from noloco_jax.training.plugins.fault_injection import FaultInjection
from noloco_jax.training.plugins.pairing_log import PairingLog
from noloco_jax.training.plugins.profiler import Profiler
from noloco_jax.training.plugins.progress import Dispatch, Progress
from noloco_jax.training.plugins.stop import StopAgreement
from noloco_jax.training.plugins.train_log import TrainLog


def from_config(run) -> Plugins:
  """The run's plug-ins. Order matters where they share a step: a step's fault (a kill) comes before its
  logs; its training row before its evaluation row; every row before the checkpoint that covers it."""
  config, single = run.config, jax.process_count() == 1
  # log_barrier=False in a multi-process job: nothing but the rounds' own exchanges and the evaluations
  # (and checkpoints) is a barrier; SIGTERM is then agreed at evaluation steps.
  stop_every = config.log_every if config.log_barrier else (config.eval_every or config.num_steps)
  plugins = [Dispatch(), Progress()]
  if run.faults is not None:
    plugins.append(FaultInjection())
  plugins.append(TrainLog(job_wide=config.log_barrier or single))
  if jax.process_index() == 0 and run.setup.schedule is not None:
    plugins.append(PairingLog(run.setup.schedule))
  plugins.append(Evaluation())
  if config.eval_consensus:
    plugins.append(ConsensusEval(config.eval_consensus))
  if config.profile_steps:
    plugins.append(Profiler(run.workdir, *parse_steps(config.profile_steps)))
  plugins += [StopAgreement(stop_every), Checkpointing()]
  return Plugins(plugins)


__all__ = ["Plugin", "Plugins", "evaluate", "from_config"]
