"""Asynchronous rounds (`outer.schedule='async'`, docs/async.md): partners found at run time.

Each process holds one replica and trains it at its own pace. After every H inner steps its round is the
method's message; `Session.round` (asynchronous/session.py), which finds a partner among the processes
ready now (waiting at most outer.asynchronous.max_wait_s) and exchanges the message with it (bounded by
exchange_timeout_s), nobody else waited for; if it exchanged, the staleness-weighted mean of the group's
messages (outer/async_rules.py) and the method's merge, i.e. the lock-step rule with a weighted group mean
(bit for bit the lock-step round at equal progress: tests/test_async_driver.py); a skipped or failed round
leaves the state as it was. Then it serves any process that asked it for its state (a (re)start).

Message, mean and merge are the round layer's programs (outer/programs.RoundPrograms, where="host"), all
compiled before the first step, for groups of two and (outer.asynchronous.match_odd='triple') of three: a
compile inside a round would keep the partners waiting (`async/round_compiles` counts any).

Training while waiting (`outer.overlap.steps` = τ > 0, docs/async.md §3): the round runs on a second host
thread (base.InFlight, as streaming overlap's) while the inner steps go on; its update is applied after
the first step by which it is done, at the latest after step tH + τ, with streaming overlap's delayed merge
(λ = outer.overlap.mix). The loop's thread only dispatches the message program (it reads the state, neither
donated nor returned, so the next inner step is dispatched at once) and, at the merge, the merge program:
finding the group, the exchange, the group's mean (`combine`) and the store read for joiners' requests are the
round's thread's (`_round`). A round in flight is not part of a checkpoint (a resume goes on as if it had been
skipped); the run's last step merges it.

Every codec (outer.codec: bfloat16 messages, int8, int4, top-k with error feedback) travels here as in
the lock-step schedule. The codec's error-feedback residual is this process's own, part of its state (so
its checkpoint keeps it): the message program hands the new residual on beside the payload and leaves the
state's as it was; the merge commits it, so a round that is skipped or fails (a partner lost mid-exchange)
leaves it as it was, as if nothing had been sent. A round's bytes are what the transport sent and
received in its exchange (session.RoundResult), counted into the run's comm/* metrics as the lock-step
schedule counts its own.

Fragment streaming (`outer.streaming.fragments` = F > 1, outer/streaming.py): every H/F steps one
fragment's round, fragment f at the steps t with (t − f·H/F) mod H = 0 (outer/streaming.boundary_fragment,
the lock-step streamed schedule's), as the round above on the fragment's part of the state: its programs
are streaming.fragment_method's (one set per fragment, all compiled before the first step), and it is
matched among the processes ready for the same fragment (Session.round's `fragment`): every fragment round
finds its own partner. The staleness rule's progress is the process's one count, whichever fragment's round
moved it. With τ > 0 one fragment's round is in flight at most (the config keeps τ < H/F).

Progress (the staleness rule's unit) and the round counters are the driver's record (`save`, `restore`),
which a checkpoint keeps. Its logs, every round (WORKDIR/pairings_<slot>.jsonl) and every membership event
it sees (WORKDIR/membership_<slot>.jsonl), are the run's kind of log (io/checkpoint/logs.JsonlLog, rows
keyed by the step): on disk before the checkpoint that covers them (`flush`), the rows after the restored
step dropped on a resume.

Joining. A process whose slot was used before in this job (asynchronous/job.py) takes its weights from a
live peer at `start`, by the method's `new_replica` (checkpoint.elastic=grow's rule), and the peer's inner
optimiser state and step, unless its own checkpoint is further along or no peer is alive. No job-wide
collective exists in this schedule, so `settle` has nothing to wait for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.asynchronous import job as job_lib
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.config import fields as config_fields
from noloco_jax.io.checkpoint import logs as logs_lib
from noloco_jax.outer import async_rules, wire
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import streaming
from noloco_jax.training.rounds.base import InFlight, RoundDriver

@dataclasses.dataclass
class _Done:
  """What the round's thread hands the loop's (AsyncRounds._round): the session's answer; if it exchanged, the
  group's mean (computed), the merged progress and the programs compiled for it; the joiners' requests."""
  result: session_lib.RoundResult
  mean: object = None
  merged: float | None = None
  compiles: int = 0
  joins: dict = dataclasses.field(default_factory=dict)


COUNTERS = ("exchanged_rounds", "skipped_rounds", "failed_rounds", "wait_s", "exchange_s", "round_compiles")
_COMPILES = threading.local()  # `counter`: the compiles of this thread while it does round work


def _on_compile(event: str, duration_s: float, **kwargs) -> None:
  del duration_s, kwargs
  counter = getattr(_COMPILES, "counter", None)
  if counter is not None and event == "/jax/core/compile/backend_compile_duration":  # jax._src.dispatch
    counter[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_compile)


class AsyncRounds(RoundDriver):

  def __init__(self, method, mesh, state_shardings, fragments, outer, *, seed: int, last_step: int, process):
    """`method`, `mesh`, `state_shardings`, `fragments`: the process's Setup's; `outer`: its config.outer;
    `seed`: config.seed (the session's draws); `process`: its place in the job (asynchronous/job.Process)."""
    if process is None:  # e.g. train_and_evaluate called directly: there are no other processes to pair with
      config_fields.fail("outer.schedule", "async", "'lockstep' outside a job of several processes started by "
                         "python -m noloco_jax.main (each process is a run of its own: docs/async.md)")
    o = outer
    self._method, self._process, self._H = method, process, o.inner_steps
    self._decay = o.asynchronous.staleness_decay
    self._options = job_lib.session_options(o, seed)
    self.session: session_lib.Session | None = None
    # Training while the round finds its partner (outer.overlap.steps = τ > 0, module docstring): the round
    # runs on a second thread and is merged with the delayed rule θ ← λ·θ_local + (1 − λ)·φ_new.
    self._tau = o.overlap.steps
    sizes = (2, 3) if o.asynchronous.match_odd == "triple" else (2,)
    # Fragment streaming (module docstring): a round every H/F steps, each fragment's programs its own.
    fragments = fragments or ()
    self._F = max(len(fragments), 1)
    self._every = self._H // self._F
    methods = [streaming.fragment_method(method, f) for f in fragments] or [method]
    self._programs = [programs_lib.RoundPrograms(m, mesh, None, state_shardings, where="host",
                                                 mix=o.overlap.mix if self._tau else None, group_sizes=sizes)
                      for m in methods]
    self.programs = self._programs[0]
    self._by_fragment: list[dict] = []  # each fragment's compiled programs
    self._compiled: dict = {}  # fragment 0's (the only one when F = 1), and the state's copy
    self._inflight = InFlight(threaded=self._tau > 0, name="async-round")
    self._merge_at = 0  # the step whose after_step merges it (decided before the step: `due` must agree)
    self._last = last_step
    self._record: dict = {}  # progress, progress_step (and where it joined from)
    self._counts: dict = {}
    self._logs: list = []

  # ---- its record ----

  def save(self) -> dict:
    return {**self._record, "counts": dict(self._counts)}

  def restore(self, record: dict) -> None:
    self._record = {k: v for k, v in record.items() if k != "counts"}
    self._counts = {f"async/{k}": 0 for k in COUNTERS}
    self._counts.update(record.get("counts", {}))

  def scalars(self) -> dict:
    return dict(self._counts)

  # ---- start: its logs, the session, a join, the programs ----

  def start(self, run) -> None:
    super().start(run)
    if not self._record:
      self._record = {"progress": float(run.loop.step), "progress_step": run.loop.step}
    slot, step = self._process.slot, run.loop.step
    pairings, events = (os.path.join(run.workdir, f"{name}_{slot}.jsonl") for name in ("pairings", "membership"))
    for path in (pairings, events):  # the rows after the restored step (all of a fresh start's): the earlier run's
      if (dropped := logs_lib.rewrite_for_resume(path, step, once=False).late):
        logging.warning("%s: dropped %d row(s) after step %d, written by the earlier run; this run writes its own.",
                        path, dropped, step)
    self._logs = [logs_lib.JsonlLog(pairings), logs_lib.JsonlLog(events)]
    self.session = session_lib.Session.from_connection(self._process, self._options, pairings=self._logs[0],
                                                       events=self._logs[1])
    self.session.step = step
    if self._process.rejoining:
      self._join(run)
    self._compile_ahead(run.state)

  def _compile_ahead(self, state) -> None:
    """Every program a round can need (groups of three included), compiled before the first step: a compile
    inside a round would keep the partner waiting (seen: seconds on a loaded CPU, more than
    outer.asynchronous.max_wait_s)."""
    start = time.monotonic()
    for programs in self._programs:
      programs.start(state)
    self._by_fragment = [dict(zip(p.fixed, p.get(*p.fixed))) for p in self._programs]
    self._compiled = self._by_fragment[0]
    # The copy of the state a joiner is served (the inner steps donate the state it would read).
    self._compiled["copy"] = jax.jit(lambda s: jax.tree.map(jnp.copy, s)).lower(state).compile()
    logging.info("Asynchronous rounds: %d programs compiled in %.1f s.", sum(map(len, self._by_fragment)),
                 time.monotonic() - start)

  def _join(self, run) -> None:
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
    run.loop.step = self.session.step = donor_step
    self._record.update(progress=float(progress), progress_step=donor_step, joined_from=donor, joined_at_step=donor_step)
    run.rate.restart(step=donor_step)

  # ---- every round ----

  def before_step(self, run, step: int) -> None:
    self.session.step = step
    if self._inflight.pending and (self._inflight.done() or step >= self._inflight.sent_at + self._tau):
      self._merge_at = step

  def due(self, step: int) -> bool:
    return step % self._every == 0 or step == self._merge_at

  def _progress(self, step: int) -> float:
    return self._record["progress"] + (step - self._record["progress_step"])

  def after_step(self, run, step: int, metrics: dict) -> None:
    _COMPILES.counter = counter = [0]
    try:
      if step == self._merge_at:
        self._finish(run, step)
      if step % self._every == 0:
        self._send(run, step)
      if step == self._last and self._inflight.pending:  # the run's state includes every round it sent
        self._finish(run, step)
    finally:
      _COMPILES.counter = None
      self._counts["async/round_compiles"] += counter[0]
      if counter[0]:
        logging.warning("Step %d: %d program(s) compiled inside the round (its partners waited).", step, counter[0])

  def _send(self, run, step: int) -> None:
    # The message program only reads the state (it is not donated, run.state stays as it is): the loop goes on
    # to the next inner step without waiting for it. The codec's new state (`codec_state`) commits with the
    # merge, if the exchange completes.
    f = streaming.boundary_fragment(step // self._every, self._F)[0] if self._F > 1 else 0
    sent, round_metrics, codec_state = self._by_fragment[f]["message"](run.state)
    own, payload = sent[0], sent[-1]  # the plain float32 payload is the own term itself, handed on once
    progress = int(round(self._progress(step)))
    self._inflight.send(step, self._round, own, payload, progress, step, f, codec_state=codec_state,
                        metrics=round_metrics, fragment=f)
    if not self._tau:  # the round at once: the exchange has happened (or not) inside `send`
      self._finish(run, step)

  def _round(self, own, payload, progress: int, step: int, fragment: int) -> "_Done":
    """The round's work off the loop's thread (with τ > 0, on InFlight's): find the group, exchange, form
    the group's mean (`_combine`), and read whether a joiner asked for this process's state, so that the
    loop's part of the round is the merge (and serving a joiner, if one asked)."""
    # Without fragments the round is called as before (Session.round's own default: fragment 0 of 1).
    result = (self.session.round(payload, progress, step) if self._F == 1 else
              self.session.round(payload, progress, step, fragment=fragment))
    done = _Done(result)
    if result.exchanged:
      # Its compiles (none: every program was compiled ahead) are counted apart: this may be another thread.
      outer, _COMPILES.counter = getattr(_COMPILES, "counter", None), [0]
      try:
        mean, done.merged = self._combine(own, result, fragment)
        # Computed here, on this thread: the merge that reads it then waits for nothing but its own arithmetic.
        done.mean = jax.block_until_ready(mean)
      finally:
        done.compiles, _COMPILES.counter = _COMPILES.counter[0], outer
    done.joins = self.session.join_requests()  # a store read: the loop serves them (`_finish`)
    return done

  def _finish(self, run, step: int) -> None:
    """The round sent at InFlight.sent_at, at `step`: its update if it exchanged, its counts and bytes; then
    any joiner that asked for this process's state is served."""
    sent_at, info = self._inflight.sent_at, self._inflight.info
    done = self._inflight.result()  # re-raises the round's error on the loop's thread
    result, mean, merged, compiles = done.result, done.mean, done.merged, done.compiles
    self._inflight.clear()
    if compiles:
      self._counts["async/round_compiles"] += compiles
      logging.warning("Step %d: %d program(s) compiled for the mean of the round sent at step %d.", step, compiles,
                      sent_at)
    self._merge_at = 0
    traffic = wire.NOTHING
    if result.exchanged:
      # The merge commits the codec's new state (from the message program) with the rule.
      run.state = self._by_fragment[info["fragment"]]["merge"](run.state, mean, info["codec_state"])
      # The τ inner steps since the message are this replica's own, on top of the group's progress.
      self._record.update(progress=merged + (step - sent_at), progress_step=step)
      traffic = wire.measured(result.bytes_sent, result.bytes_received, len(result.group) - 1)
    counts = self._counts
    counts[f"async/{result.status}_rounds"] += 1
    counts["async/wait_s"] += result.waited_s
    counts["async/exchange_s"] += result.exchange_s
    counts["async/progress"] = self._progress(step)
    run.loop.add_round(step, info["metrics"], traffic)
    if done.joins:  # a joiner is offered a copy (the inner steps donate the state), with its progress now
      self.session.serve_joins(lambda: self._compiled["copy"](run.state), progress=int(round(self._progress(step))),
                               requests=done.joins)

  def _combine(self, own, result, fragment: int = 0):
    """(the group's mean, merged progress) after an exchange: the staleness-weighted mean of the messages in
    the lock-step order; with fragment streaming, fragment `fragment`'s program. It reads no state: the
    round's thread forms it (`_round`)."""
    compiled = self._by_fragment[fragment]
    me = self._process.slot
    group = list(result.group)  # sorted by slot, this process included
    received = dict(zip([s for s in group if s != me], result.messages[1:]))
    progress_of = dict(zip([me] + [s for s in group if s != me], result.progress))
    j = group.index(me)
    order = [me] + [group[(j + shift) % len(group)] for shift in range(1, len(group))]  # as outer/exchange.py
    others = tuple(received[s] for s in order[1:])
    progress = [progress_of[s] for s in order]
    weights = async_rules.staleness_weights(progress, inner_steps=self._H, decay=self._decay)
    if async_rules.equal(weights):
      mean = compiled[f"combine{len(group)}"](own, others)
    else:
      mean = compiled[f"combine{len(group)}w"](own, others, np.asarray(weights, np.float32))  # no jnp: a compile
    return mean, async_rules.merged_progress(progress, weights)

  def flush(self) -> None:
    for log in self._logs:
      log.sync()

  def close(self, failed: bool) -> None:
    """Leaves the job: the others see it gone at their next poll (never paired with it again)."""
    self._inflight.close(failed)
    for programs in self._programs:
      programs.close()
    if self.session is not None:
      # Still beating until the process exits (asynchronous/job.Process.finish): it saves and logs meanwhile.
      self.session.close(linger_s=0.0, keep_beating=True)
      self.session = None
    for log in self._logs:
      log.close()
