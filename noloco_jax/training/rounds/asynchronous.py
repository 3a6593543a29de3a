"""Asynchronous rounds (`outer.schedule='async'`, docs/async.md): partners found at run time.

Each process holds one replica and trains it at its own pace. After every H inner steps its round is:

1. **message**: the method's own message program (outer/methods.RoundParts.message: c = β·θ + (γ − β)·φ,
   cast to outer.message_dtype), on this process's devices;
2. **pairing**: `Session.round` (asynchronous/session.py) asks the matchmaker for a partner among the
   processes ready now, waiting at most outer.max_wait_s, and exchanges the message with it over
   jax.experimental.transfer, bounded by outer.exchange_timeout_s. Nobody else is waited for;
3. **update**, if the exchange happened: the staleness-weighted mean of the group's messages
   (outer/async_rules.py: each weighted by exp(−λ · its lag in rounds)), then the method's own merge
   program (RoundParts.merge: δ ← α·δ + m − γ·φ; φ ← φ + δ; θ ← φ), exactly the lock-step rule with
   the group mean replaced by the weighted one. With equal progress the mean is the lock-step group
   mean, summed in the lock-step order (own, then the group's members cyclically after it), so the
   round is the lock-step round bit for bit (tests/test_async_driver.py).
   If no partner came (skipped) or the exchange failed, the state stays as it was and the replica
   trains on: its next message carries both rounds' progress;
4. **serving joiners**: a process that (re)started into the running job may have asked this one for
   its state (one store read per round).

Training while waiting (`outer.overlap_steps` = τ > 0). Steps 2 and 3 block the process until its
partner is ready and the exchange is done: with P processes whose ready times spread over a round, the
first of each pair waits for the next arrival (docs/async.md §3). With τ > 0 the round (2 and 3) runs on
a second host thread while the inner steps go on, and its update is applied after the first step by
which it is done, at the latest after step tH + τ (the process then waits for it), with streaming
overlap's delayed merge: φ and δ from the group mean as in step 4 (they did not change meanwhile),
θ ← λ·θ_local + (1 − λ)·φ_new (λ = `outer.overlap_mix`, docs/method.md §13); the steps taken meanwhile
count on top of the group's merged progress. A round in flight is not part of a checkpoint (nor waited
for by an evaluation, which sees θ as it is): a resume from that checkpoint goes on as if the round
had been skipped; at the run's last step the round in flight is merged.

Progress (the staleness rule's unit, async_rules.py): inner steps behind the replica's weights; it
grows by one per inner step and after an exchange becomes the group's weighted mean. It is kept, with
the round counters, in the loop state's history, so a checkpoint restores it.

Joining. A process whose slot was used before in this job (asynchronous/job.py: a restart, or a slot
reserved at start-up) takes its weights from a live peer at `start`, by checkpoint.elastic=grow's rule:
the peer's φ as θ and φ, δ = 0 (the method's `new_replica`), the peer's inner optimiser state and step
(so the learning-rate schedule continues where the job is). It keeps its own data position (from its
own checkpoint, else the start of its shard). It does not join when its own checkpoint is further
along than the peer, or when no peer is alive (then it trains on from its own state).

No job-wide collective exists in this schedule, so `settle` has nothing to wait for: every exchange
has completed (or failed) inside `after_step`, or (τ > 0) runs on its own thread, touching no state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.asynchronous import job as job_lib
from noloco_jax.config import fields as config_fields
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.outer import async_rules
from noloco_jax.outer import wire
from noloco_jax.training.rounds.base import RoundDriver

@dataclasses.dataclass
class _Pending:
  """A round sent: its result (a Future, with τ > 0), own float32 message, payload, step and metrics."""
  future: concurrent.futures.Future | None
  own: object
  payload: object
  sent_at: int
  round_metrics: dict


SCALARS = "schedule"  # loop.history[SCALARS]: cumulative counters every training row carries (train_log.py)
PRIVATE = "async"  # loop.history[PRIVATE]: this driver's own record (progress)


class AsyncRounds(RoundDriver):

  def __init__(self, setup, process):
    """`process`: this process's place in the job (asynchronous/job.Process)."""
    config = setup.config
    if process is None:  # e.g. train_and_evaluate called directly: there are no other processes to pair with
      config_fields.fail("outer.schedule", "async", "'lockstep' outside a job of several processes started by "
                         "python -m noloco_jax.main (each process is a run of its own: docs/async.md)")
    self._method, self._process, self._H = setup.method, process, config.outer.inner_steps
    self._decay = config.outer.staleness_decay
    self._options = job_lib.session_options(config)
    self.session: session_lib.Session | None = None
    parts = setup.method.parts
    # Training while the round finds its partner (outer.overlap_steps = τ > 0, module docstring): the round
    # runs on a second thread and is merged with the delayed rule θ ← λ·θ_local + (1 − λ)·φ_new.
    self._tau = config.outer.overlap_steps
    mix = config.outer.overlap_mix if self._tau else None
    self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-round")
                      if self._tau else None)
    self._pending: _Pending | None = None  # the round in flight (τ > 0)
    self._merge_at = 0  # the step whose after_step merges it (decided before the step: `due` must agree)
    self._last = config.num_steps

    def message(states):
      states, own, payload, metrics = parts.message(states)
      # The plain float32 payload is the own term bit for bit: returned once (XLA gives every output a buffer
      # of its own, so returning it twice would copy a model).
      return states, (None if parts.own_is_payload else own), payload, metrics

    # The message donates the state it returns: undonated, XLA copied every leaf of it (θ, φ, δ and the inner
    # optimizer's moments) into new buffers, 10 of the program's 17 model copies of memory traffic.
    self._message_fn = jax.jit(message, donate_argnums=0)
    # The merge donates the state it replaces (as the lock-step round does).
    self._merge_fn = jax.jit(lambda states, mean: parts.merge(states, mean, mix), donate_argnums=0)
    self._equal_mean_fn = jax.jit(lambda messages: async_rules.weighted_mean(messages, None))
    self._weighted_mean_fn = jax.jit(async_rules.weighted_mean)
    # Groups of three (outer.match_odd='triple'): compiled on first use (a triple is rarer than a pair).
    self._equal_mean_any = jax.jit(lambda messages: async_rules.weighted_mean(messages, None))
    self._weighted_mean_any = jax.jit(async_rules.weighted_mean)

  # ---- start: the session, a join, the programs ----

  def start(self, run) -> None:
    self.session = session_lib.Session.from_connection(self._process, self._options, log_dir=run.workdir)
    record = run.loop.history.setdefault(PRIVATE, {"progress": float(run.loop.step), "progress_step": run.loop.step})
    run.loop.history.setdefault(SCALARS, {f"async/{k}": 0 for k in ("exchanged_rounds", "skipped_rounds",
                                                                     "failed_rounds", "wait_s", "exchange_s")})
    if self._process.rejoining:
      self._join(run, record)
    self._compile_ahead(run.state)

  def _compile_ahead(self, state) -> None:
    """The round's programs, compiled before the first step: a compile inside a round would keep the
    partner waiting (seen: seconds on a loaded CPU, more than outer.max_wait_s)."""
    start = time.monotonic()
    _, own, payload, _ = jax.eval_shape(self._message_fn, state)
    own = payload if own is None else own
    self._message_fn = self._message_fn.lower(state).compile()
    self._merge_fn = self._merge_fn.lower(state, own).compile()
    self._equal_mean_fn = self._equal_mean_fn.lower([own, payload]).compile()
    self._weighted_mean_fn = self._weighted_mean_fn.lower([own, payload], jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    logging.info("Asynchronous rounds: programs compiled in %.1f s.", time.monotonic() - start)

  def _join(self, run, record) -> None:
    """Takes this replica's state from a live peer (module docstring)."""
    try:
      state, donor, progress = self.session.join(run.state)
    except (RuntimeError, ValueError) as e:
      logging.warning("Slot %d could not join from a live peer (%s); it trains on from its own state (step %d).",
                      self._process.slot, e, run.loop.step)
      return
    donor_step = int(np.asarray(state.step).reshape(-1)[0])
    if donor_step < run.loop.step:
      logging.warning("Slot %d: its own checkpoint (step %d) is further along than donor slot %d (step %d); it "
                      "keeps its own state.", self._process.slot, run.loop.step, donor, donor_step)
      return
    one = jax.tree.map(lambda x: np.asarray(x)[0], (state.params, state.outer))
    params, outer = self._method.new_replica(*one)  # θ = φ_peer, δ = 0: checkpoint.elastic=grow's rule
    new = state.replace(params=jax.tree.map(lambda x: x[None], params), outer=jax.tree.map(lambda x: x[None], outer))
    run.state = jax.tree.map(lambda x, like: jax.device_put(np.asarray(x).astype(like.dtype), like.sharding),
                             new, run.state)
    dropped = len(run.loop.take_pending()[0])
    logging.info("Slot %d joined the running job from slot %d: its state at step %d (progress %d); the loop "
                 "continues from there%s.", self._process.slot, donor, donor_step, progress,
                 f" ({dropped} steps of this process's unlogged metrics dropped)" if dropped else "")
    run.loop.step = donor_step
    record.update(progress=float(progress), progress_step=donor_step, joined_from=donor, joined_at_step=donor_step)
    run.rate.restart(step=donor_step)

  # ---- every round ----

  def before_step(self, run, step: int) -> None:
    pending = self._pending
    if pending is not None and (pending.future.done() or step >= pending.sent_at + self._tau):
      self._merge_at = step

  def due(self, step: int) -> bool:
    return step % self._H == 0 or step == self._merge_at

  def _progress(self, record, step: int) -> float:
    return record["progress"] + (step - record["progress_step"])

  def after_step(self, run, step: int, metrics: dict) -> None:
    if step == self._merge_at:
      self._finish(run, step)
    if step % self._H == 0:
      self._send(run, step)
    if step == self._last and self._pending is not None:  # the run's state includes every round it sent
      self._finish(run, step)

  def _send(self, run, step: int) -> None:
    states, own, payload, round_metrics = self._message_fn(run.state)
    own = payload if own is None else own
    # The state's buffers went to the message program (donated): the state it returned is the state now.
    run.state = states
    progress = self._progress(run.loop.history[PRIVATE], step)
    if self._executor is None:
      self._pending = _Pending(None, own, payload, step, round_metrics)
      self._finish(run, step, states, self.session.round(payload, progress=int(round(progress))))
    else:
      self._pending = _Pending(self._executor.submit(self.session.round, payload, int(round(progress))), own, payload,
                               step, round_metrics)
    # A joiner may be waiting for this process: it is offered a copy (the inner steps donate the state).
    record = run.loop.history[PRIVATE]
    self.session.serve_joins(lambda: jax.tree.map(jnp.copy, run.state), progress=int(round(self._progress(record, step))))

  def _finish(self, run, step: int, states=None, result=None) -> None:
    """The round sent at pending.sent_at, at `step`: its update if it exchanged, its counts and bytes."""
    pending, self._pending, self._merge_at = self._pending, None, 0
    if result is None:
      result = pending.future.result()  # re-raises the round's error on the loop's thread
    record, counts = run.loop.history[PRIVATE], run.loop.history[SCALARS]
    traffic = wire.NOTHING
    if result.exchanged:
      run.state, merged = self._apply(run.state if states is None else states, pending.own, result)
      # The τ inner steps since the message are this replica's own, on top of the group's progress.
      record.update(progress=merged + (step - pending.sent_at), progress_step=step)
      traffic = wire.permute(sum(x.nbytes for x in jax.tree.leaves(pending.payload)), len(result.group) - 1)
    counts[f"async/{result.status}_rounds"] += 1
    counts["async/wait_s"] += result.waited_s
    counts["async/exchange_s"] += result.exchange_s
    counts["async/progress"] = self._progress(record, step)
    run.loop.add_round(step, pending.round_metrics, traffic)

  def _apply(self, states, own, result):
    """(new state, merged progress) after an exchange: the weighted mean in the lock-step order, the merge."""
    me = self._process.slot
    group = list(result.group)  # sorted by slot, this process included
    received = dict(zip([s for s in group if s != me], result.messages[1:]))
    progress_of = dict(zip([me] + [s for s in group if s != me], result.progress))
    j = group.index(me)
    order = [me] + [group[(j + shift) % len(group)] for shift in range(1, len(group))]  # as outer/exchange.py
    messages = [own] + [received[s] for s in order[1:]]
    progress = [progress_of[s] for s in order]
    weights = async_rules.staleness_weights(progress, inner_steps=self._H, decay=self._decay)
    if async_rules.equal(weights):
      mean = self._call(self._equal_mean_fn, messages, None)
    else:
      mean = self._call(self._weighted_mean_fn, messages, weights)
    return self._merge_fn(states, mean), async_rules.merged_progress(progress, weights)

  def _call(self, compiled, messages, weights):
    """The pair's program compiled at start, or (a triple) the one jitted for three on first use."""
    if len(messages) != 2:
      compiled = self._equal_mean_any if weights is None else self._weighted_mean_any
    return compiled(messages) if weights is None else compiled(messages, jnp.asarray(weights))

  def close(self, failed: bool) -> None:
    """Leaves the job: the others see it gone at their next poll (never paired with it again)."""
    if self._executor is not None:
      self._executor.shutdown(wait=not failed, cancel_futures=True)
    if self.session is not None:
      # Still beating until the process exits (asynchronous/job.Process.finish): it saves and logs meanwhile.
      self.session.close(linger_s=0.0, keep_beating=True)
      self.session = None
