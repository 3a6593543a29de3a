"""Round drivers: what happens at round boundaries (base.py: the interface the loop calls).

`make_driver(setup, run)` chooses the schedule from the config and wraps it in the cross-cutting
behaviour the run asks for (wrappers.py). A new schedule is one module here and one line below.
"""

from __future__ import annotations

import logging

import jax

from noloco_jax.io.checkpoint import guard as guard_lib
from noloco_jax.outer import streaming as streaming_lib
from noloco_jax.training.rounds import wrappers
from noloco_jax.training.rounds.asynchronous import AsyncRounds
from noloco_jax.training.rounds.base import NoRounds, RoundDriver
from noloco_jax.training.rounds.lockstep import LockstepRounds
from noloco_jax.training.rounds.overlapped import OverlappedRounds, threaded_exchange_is_safe
from noloco_jax.training.rounds.streaming import StreamingRounds


def make_driver(setup, run) -> RoundDriver:
  """The run's round driver, wrapped by the skip-round guard and the round trace when they are on."""
  config, method = setup.config, setup.method
  o = config.outer
  if not method.has_rounds:
    driver = NoRounds()
  elif o.schedule == "async":  # one process of an asynchronous job (asynchronous/job.py)
    driver = AsyncRounds(method, setup.mesh, setup.state_shardings, setup.fragments, o, seed=config.seed,
                         last_step=config.num_steps, process=setup.process)
  elif setup.fragments is not None:  # fragment streaming (outer.streaming.*): one fragment's round every H/F steps
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), run.state.params)
    traffic = [streaming_lib.fragment_method(method, f).traffic(one, config.num_replicas)[0] for f in setup.fragments]
    driver = StreamingRounds(method, setup.fragments, setup.mesh, setup.schedule, setup.state_shardings,
                             inner_steps=o.inner_steps, tau=o.overlap.steps, mix=o.overlap.mix,
                             last_step=config.num_steps, traffic=traffic,
                             threaded=threaded_exchange_is_safe(fsdp=config.fsdp, num_stages=config.num_stages))
  elif o.overlap.steps:
    threaded = threaded_exchange_is_safe(fsdp=config.fsdp, num_stages=config.num_stages)
    logging.info("Streaming overlap: τ=%d steps, λ=%s; the exchange is called %s.", o.overlap.steps, o.overlap.mix,
                 "on a second thread" if threaded else "in order on the main thread")
    driver = OverlappedRounds(method, setup.mesh, setup.schedule, setup.state_shardings, inner_steps=o.inner_steps,
                              tau=o.overlap.steps, mix=o.overlap.mix, last_step=config.num_steps,
                              traffic=run.traffic_per_round, threaded=threaded)
  else:
    driver = LockstepRounds(setup.rounds, o.inner_steps, run.traffic_per_round, last_step=config.num_steps)
  if config.nan_policy == "skip_round":
    # A round ends every H steps, or every H/F with fragment streaming (each fragment's round is undone alone).
    every = o.inner_steps // (len(setup.fragments) if setup.fragments else 1)
    driver = wrappers.Guarded(driver, guard_lib.RoundGuard(every, config.nan_max_skipped_rounds, setup.mesh,
                                                           run.loop.history))
  if run.faults is not None and run.faults.tracing:
    driver = wrappers.Traced(driver, run.faults)
  return driver


__all__ = ["AsyncRounds", "LockstepRounds", "NoRounds", "OverlappedRounds", "RoundDriver", "StreamingRounds", "make_driver"]
