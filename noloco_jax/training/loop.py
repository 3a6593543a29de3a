"""The training loop: rounds of H inner steps on every replica, then one outer step.

`train_and_evaluate(config, workdir)` is what main.py, the tests and the notebooks call. It reads top
to bottom: set-up (build.py), data, the state built sharded (or restored with the loop's state,
loop_state.py), then the loop. Logging, evaluation and the end-of-run summary are the helpers below it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from noloco_jax.io import checkpoint as checkpoint_lib
from noloco_jax.io import data as data_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.io import process_metrics
from noloco_jax.runtime import workdir_lock
from noloco_jax.outer import overlap as overlap_lib
from noloco_jax.runtime import distributed
from noloco_jax.runtime import preemption
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.training import faults
from noloco_jax.training import build as build_lib
from noloco_jax.training import dispatch
from noloco_jax.training import summary as summary_lib
from noloco_jax.training.loop_state import LoopState

NonFiniteLossError = checkpoint_lib.NonFiniteLossError


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config.num_replicas` replicas for `config.num_steps` steps; returns the final metrics.

  One run per workdir: the workdir is locked for the whole run (runtime/workdir_lock.py).
  """
  os.makedirs(workdir, exist_ok=True)
  with workdir_lock.hold(workdir):
    return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  start_time = time.time()
  setup = build_lib.build(config)
  config = setup.config  # validated: renamed fields under their new names
  mesh, n, H = setup.mesh, config.num_replicas, config.outer.inner_steps
  is_main = jax.process_index() == 0
  train_iter, eval_batches = _open_data(setup)

  # ---- State, built sharded. ----
  state = setup.init_state()
  # All processes agree on config/seed/layout, share the workdir, and every replica starts bit-identical
  # (before any restore).
  distributed.check_consistency(config, mesh, state, workdir=workdir)
  # Then the latest checkpoint of this workdir, else the warm start, else this fresh state (io/checkpoint).
  checkpointer = checkpoint_lib.Checkpointer(setup, workdir)
  # Streaming overlap (outer.overlap_steps > 0): a round's exchange stays in flight for τ inner steps
  # (outer/overlap.py); its mean is part of every checkpoint.
  exchanges = _exchanges(setup, state) if config.outer.overlap_steps else None
  if exchanges is not None:
    state, loop = checkpointer.restore(exchanges.for_checkpoint(state), train_iter, LoopState())
    state = exchanges.from_checkpoint(state, loop.inflight_step)
  else:
    state, loop = checkpointer.restore(state, train_iter, LoopState())
  if is_main:  # only now: a refused resume leaves the config that describes the checkpoints
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  bytes_per_round = setup.method.bytes_per_round(one_replica)
  bytes_per_step = setup.method.bytes_per_step(one_replica)

  writer = metrics_lib.make_writer(workdir, config)
  # Without log_barrier, nothing between two evaluations waits for another process except the outer
  # round's own exchange with partners: training rows are this process's replicas (io/process_metrics.py),
  # the per-round weight std (an all-reduce over every replica) is left to evaluations, and SIGTERM is
  # agreed at evaluation steps. One process has no such collective, so it always logs everything.
  local_ids = mesh_lib.local_replica_ids(mesh, n)
  job_wide = config.log_barrier or jax.process_count() == 1
  plog = process_metrics.ProcessLog(workdir, writer, len(local_ids), start_step=loop.step)
  stop_every = config.log_every if config.log_barrier else (config.eval_every or config.num_steps)
  fault = faults.from_env()  # NOLOCO_FAULTS (tests, experiments/bench_network.py); else nothing
  if not loop.resumed:
    writer.write_scalars(0, {"model/num_params": setup.model.num_params()})
  pairing_log = checkpoint_lib.JsonlLog(os.path.join(workdir, "pairings.jsonl")) if is_main and setup.schedule else None
  report = metrics_lib.writers.ProgressLog(num_train_steps=config.num_steps, every_secs=30)
  rate = _StepRate(loop.step, n * config.data.batch_size * config.data.seq_len)
  guard = checkpoint_lib.RoundGuard(config, mesh, loop.history)  # active only with nan_policy="skip_round"
  # The host stays at most a few steps ahead of the devices: queuing more deadlocks XLA:CPU's
  # collectives (training/dispatch.py explains how).
  window = dispatch.DispatchWindow()
  # Round r's program compiles in the background during round r's inner steps (outer/ahead.py).
  round_programs = setup.rounds.ahead(state) if setup.method.has_rounds and exchanges is None else None
  for programs in (round_programs, exchanges):
    if programs is not None:
      programs.prefetch(loop.round)
  if not loop.resumed:
    _evaluate_and_log(setup, state, eval_batches, writer, loop, 0)  # step 0: the untrained baseline

  preempted = False
  try:
    for step in range(loop.step + 1, config.num_steps + 1):
      guard.begin(step, state)
      state, step_metrics = setup.inner_step(state, sharding_lib.global_array(mesh, next(train_iter), n))
      guard.observe(step_metrics["loss"])
      loop.add_step(step, step_metrics, bytes_per_step)

      if setup.method.has_rounds and step % H == 0:
        fault.before_round(state)
        if pairing_log is not None:
          row = {"round": loop.round, "step": step, "groups": [list(g) for g in setup.schedule.groups(loop.round)]}
          if setup.schedule.mode == "round_robin":
            row["matching"] = setup.schedule.index(loop.round)
          pairing_log.append(row)
        if exchanges is None:
          round_fn, route = round_programs.program(loop.round)  # also starts compiling the next round's
          fault.after_program(round_programs.compiler.stats)  # NOLOCO_TRACE: the wait for the compile
          state, round_metrics = round_fn(state, route)
          loop.add_round(round_metrics, setup.weight_std(state.params) if job_wide else None, bytes_per_round)
        else:  # sent now, merged after step + τ (below): the inner steps in between do not wait for it
          loop.add_round(exchanges.send(state, loop.round, step), None, bytes_per_round)
          fault.after_program(exchanges.sends.compiler.stats)
          loop.inflight_step = step
      if exchanges is not None and exchanges.merge_due(step, config.num_steps):
        fault.before_round(state)  # NOLOCO_TRACE counts the wait for the exchange as the round's time
        state = exchanges.merge(state)
        loop.inflight_step = 0
        if job_wide:
          loop.set_round_weight_std(setup.weight_std(state.params))
      state = guard.end(step, state, loop.history)
      window.push(step_metrics["loss"])
      report(step)
      fault.after_step(step, state)

      if step % max(config.log_every, 1) == 0 or step == config.num_steps:
        if exchanges is not None and job_wide:
          exchanges.settle()  # the job-wide log's gather is a collective: never beside one in flight
        scalars = _train_scalars(config, loop, rate.since_last_log(step), None if job_wide else local_ids)
        (writer.write_scalars if config.log_barrier else plog.write_train)(step, scalars)
      if (config.eval_every and step % config.eval_every == 0) or step == config.num_steps:
        with report.timed("eval"):
          if exchanges is not None:
            exchanges.settle()  # evaluation gathers over processes; θ is evaluated as it is (unmerged)
          _evaluate_and_log(setup, state, eval_batches, writer, loop, step, plog)
        rate.restart()  # keep evaluation out of the steps/s figure

      if exchanges is not None and step % max(stop_every, 1) == 0:
        exchanges.settle()  # the stop agreement gathers over processes
      preempted = preemption.stop_requested(step, stop_every)  # SIGTERM; agreed by all processes
      if checkpointer.due(step) or preempted:
        # Every log row up to this step on disk before the checkpoint that covers it (checkpoint/logs.py).
        writer.flush()
        if pairing_log is not None:
          pairing_log.sync()
        # checks the pending losses and the state first; with overlap, the mean in flight is saved too
        checkpointer.save(step, exchanges.for_checkpoint(state) if exchanges is not None else state, loop, train_iter)
      if preempted:
        logging.warning("Stop requested: saved a checkpoint at step %d; run the same command to resume.", step)
        break
  except BaseException:
    if round_programs is not None:
      round_programs.close()
    if exchanges is not None:
      exchanges.close(wait=False)  # a send may be stuck on a partner that failed
    # Leave no prefetch thread or open writer behind an error (e.g. a NaN stop in a notebook), and
    # flush the metrics written so far. A save in flight is completed (or, in a multi-process job whose
    # peers may be the ones that failed, abandoned after a bounded wait, saying so): never lost silently.
    checkpointer.settle_after_error()
    for closable in (train_iter, plog, writer, pairing_log):
      with contextlib.suppress(Exception):
        if closable is not None:
          closable.close()
    raise

  for programs in (round_programs, exchanges):
    if programs is not None:
      programs.close()
  checkpointer.close()  # the last (asynchronous) save is complete before the run reports
  plog.close()  # process 0 merges the rows that have arrived (all of them after the final evaluation)
  writer.flush()
  train_iter.close()
  if pairing_log is not None:
    pairing_log.close()
  if preempted:
    writer.close()
    return {"preempted": True, "step": loop.step, "state": state, "history": loop.history}
  summary = summary_lib.summarize(config, loop, setup.model.num_params(), time.time() - start_time)
  if is_main:
    print(summary["text"], flush=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "text"}, f, indent=2)
  writer.write_summary({k: v for k, v in summary.items() if k != "text"})
  writer.close()
  return {**summary, "state": state, "history": loop.history}


# ---------------------------------------------------------------------------------------------------
# Helpers of the loop, in the order it uses them.
# ---------------------------------------------------------------------------------------------------


def _exchanges(setup: build_lib.Setup, state) -> overlap_lib.Exchanges:
  """The overlapped rounds (outer/overlap.py); the send runs on a second thread where that is measured safe."""
  programs = overlap_lib.Programs(setup.method, setup.mesh, setup.schedule, setup.state_shardings)
  threaded = overlap_lib.threaded_send_is_safe(setup.config)
  logging.info("Streaming overlap: τ=%d steps, λ=%s; the exchange is called %s.", setup.config.outer.overlap_steps,
               setup.config.outer.overlap_mix, "on a second thread" if threaded else "in order on the main thread")
  return overlap_lib.Exchanges(programs, state, setup.config.outer.overlap_steps, threaded=threaded)


def _open_data(setup: build_lib.Setup):
  """(training iterator over this process's replicas, validation batches replicated on the mesh)."""
  config, mesh, n = setup.config, setup.mesh, setup.config.num_replicas
  local_ids = mesh_lib.local_replica_ids(mesh, n)  # each process reads only the replicas its devices hold
  train_iter = data_lib.make_train_iterator(config.data, seed=config.seed, replica_ids=local_ids, num_replicas=n,
                                            vocab_size=setup.model.vocab_size)
  # The validation sample is drawn with a fixed seed, not config.seed, so that runs with different
  # seeds (e.g. compare_methods.py) are scored on the same sequences.
  eval_batches = jax.device_put(data_lib.make_eval_batches(config.data, seed=0, vocab_size=setup.model.vocab_size),
                                mesh_lib.replicated(mesh))
  logging.info("Global batch: %d replicas × %d sequences × %d tokens; %d devices (%d replicas each); "
               "process %d of %d holds replicas %s.", n, config.data.batch_size, config.data.seq_len,
               mesh.devices.size, mesh_lib.replicas_per_device(mesh, n), jax.process_index(),
               jax.process_count(), local_ids)
  return train_iter, eval_batches


class _StepRate:
  """Steps/s and tokens/s since the last log, evaluation time left out."""

  def __init__(self, step: int, tokens_per_step: int):
    self._time, self._step, self._tokens_per_step = time.time(), step, tokens_per_step

  def since_last_log(self, step: int) -> dict[str, float]:
    now = time.time()
    steps_per_s = (step - self._step) / max(now - self._time, 1e-9)
    self._time, self._step = now, step
    return {"perf/steps_per_s": steps_per_s, "perf/tokens_per_s": steps_per_s * self._tokens_per_step}

  def restart(self) -> None:
    self._time = time.time()


def evaluate(setup: build_lib.Setup, state, eval_batches: jax.Array) -> dict[str, float]:
  """eval/loss = mean over replicas of each replica's mean validation loss; eval/ppl = exp of it."""
  losses = []
  for i in range(eval_batches.shape[0]):
    losses.append(setup.eval_step(state.params, eval_batches[i]))
    if (i + 1) % dispatch.EVAL_CHUNK == 0:  # bounded run-ahead: see training/dispatch.py
      jax.block_until_ready(losses[-1])
  losses = mesh_lib.fetch(losses)  # per-replica losses live on every process: one all-gather
  per_replica = np.mean(np.stack([np.asarray(x) for x in losses]), axis=0)
  loss = float(np.mean(per_replica))
  return {"eval/loss": loss, "eval/ppl": float(np.exp(loss)),
          "replicas/weight_std": float(setup.weight_std(state.params))}


def _evaluate_and_log(setup, state, eval_batches, writer, loop: LoopState, step: int, plog=None) -> None:
  scalars = evaluate(setup, state, eval_batches)  # a barrier: every process's rows up to `step` are written
  if plog is not None:
    plog.sync()  # so process 0 merges them before the evaluation row: metrics.jsonl stays in step order
  writer.write_scalars(step, scalars)
  loop.history["eval"].append({"step": step, **scalars})


def _train_scalars(config, loop: LoopState, rates: dict[str, float], local_ids=None) -> dict[str, Any]:
  """The log step's training scalars, from the metrics pending since the last log (then cleared).

  local_ids None: every replica, by one gather per log interval (a collective over all processes in a
  multi-process job), never per step. Else only these replicas, read from this process's shards.
  """
  steps, metrics, rounds = loop.take_pending()
  if local_ids is None:
    metrics, rounds = mesh_lib.fetch((metrics, rounds))
  else:
    metrics, rounds = process_metrics.local_fetch((metrics, rounds), local_ids, config.num_replicas)
  losses = np.stack([np.asarray(m["loss"]) for m in metrics])
  if config.nan_policy == "error":
    # A NaN on this process stops this process; the job then ends through distributed.py's failure path.
    checkpoint_lib.check_finite(losses, steps, local_ids)
  scalars = {
      "train/loss": float(losses.mean()),
      "train/grad_norm": float(np.mean([np.asarray(m["grad_norm"]) for m in metrics])),
      "comm/bytes_per_replica": loop.comm_bytes,
      "outer/round": loop.round,
      **rates,
  }
  if config.nan_policy == "skip_round":
    scalars["outer/skipped_rounds"] = len(loop.history.get("skipped_rounds", []))
  if rounds:
    scalars["outer/pseudo_grad_norm"] = float(np.mean([np.asarray(m["pseudo_grad_norm"]) for m, _ in rounds]))
    if rounds[-1][1] is not None:  # None: not computed (a global all-reduce; see log_barrier)
      scalars["replicas/weight_std"] = float(rounds[-1][1])
  loop.history["train"] = scalars
  return scalars
