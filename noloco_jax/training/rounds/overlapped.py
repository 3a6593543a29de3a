"""Streaming overlap: a round's exchange in flight while the next τ inner steps run (docs/method.md §13).

`outer.overlap_steps = τ > 0` (noloco, gossip, any codec) cuts the round of step tH in the method's
three parts (outer/methods.RoundParts, compiled by outer/rounds.SplitPrograms):

- at step tH, **send**: the message program computes the round's message and its payload (a local
  program; the codec's error-feedback residual is updated here), then the exchange program forms the
  group mean, the only program that communicates. It reads the message alone, not the state, so the
  inner steps tH+1 … tH+τ, which donate the state, never wait for it;
- after step tH + τ, **merge**: φ, δ ← the NoLoCo rule with the arrived mean (exactly as without
  overlap) and θ ← λ·θ_local + (1 − λ)·φ (λ = `outer.overlap_mix`).

What actually runs concurrently was measured on XLA:CPU (experiments/bench_overlap.py, RESULTS.md): a
program with a cross-process collective executes inline in the thread that calls it, so the call
returns only when the exchange has finished, and the next program is dispatched after it. Neither
async dispatch nor one program holding both the exchange and independent compute overlapped them.
Calling the exchange program from a second host thread does: the main thread keeps dispatching inner
steps while the worker thread sits in the exchange. So with one local device per process on CPU
(`threaded`), the exchange is called on a one-thread executor. Elsewhere (several local devices, where
XLA:CPU's gang-scheduled thread pool must not be shared with a pending collective, see
training/plugins/dispatch.py; or other backends, not measured) it is dispatched in order on the main thread:
the arithmetic is the same, only nothing is hidden.

`settle` (before evaluation, a job-wide log, the stop agreement, a checkpoint) waits for the exchange
and puts its group mean into the state's in-flight buffer (`methods.INFLIGHT`, one float32 model copy
per replica, part of the method's state), which the merge reads. So the state has one shape whatever
is in flight, every checkpoint holds the mean in flight (`LoopState.inflight_step` says whether one
is), and a run stopped inside a window resumes bitwise. At the run's last step an exchange still in
flight is merged there (after fewer than τ steps), so the final state includes every exchange sent.
"""

from __future__ import annotations

import concurrent.futures

import jax

from noloco_jax.outer import ahead as ahead_lib
from noloco_jax.outer import methods
from noloco_jax.outer import rounds as rounds_lib
from noloco_jax.training.rounds import lockstep
from noloco_jax.training.rounds.base import RoundDriver


def threaded_exchange_is_safe(*, fsdp: int, num_stages: int) -> bool:
  """Whether the exchange may run on a second host thread: measured safe and useful only on XLA:CPU with
  one local device per process, with inner steps that hold no collective (no fsdp, no pipeline stages)."""
  return (jax.default_backend() == "cpu" and jax.process_count() > 1 and jax.local_device_count() == 1
          and fsdp == 1 and num_stages == 1)


class OverlappedRounds(RoundDriver):
  """`send` at step tH, `merge` after step tH + τ (module doc)."""

  def __init__(self, method, mesh, schedule, state_shardings, *, inner_steps: int, tau: int, mix: float,
               last_step: int, traffic, threaded: bool):
    """`state_shardings`: the state's home layout (None: every leaf split over `replica`, as tests build)."""
    self._programs = rounds_lib.SplitPrograms(method, mesh, schedule, state_shardings, mix)
    self._home = state_shardings.outer[methods.INFLIGHT] if state_shardings is not None else None
    self.tau, self._last, self._H, self._traffic = tau, last_step, inner_steps, traffic
    self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-exchange")
                      if threaded else None)
    # The exchange in flight: a Future, or its mean itself (dispatched inline); None once its mean is in the
    # state (settled or restored) or when nothing is in flight.
    self._pending = None
    self.sent_at = 0  # the step whose exchange is in flight (0: none)
    self._local = self._exchanges = None

  def start(self, run) -> None:
    programs, state = self._programs, run.state
    abstract = rounds_lib.abstract(state)
    # The message and merge programs compile in the background from the start, like the exchange
    # programs: otherwise the first round would wait for a compile (seen: 3 s on a loaded CPU).
    structs = programs.message_structs(abstract)
    lower = {"message": lambda: programs.message.lower(abstract), "merge": lambda: programs.merge.lower(abstract)}
    self._local = ahead_lib.AheadCompiler(lambda key: lower[key](), capacity=2)
    for key in lower:
      self._local.prefetch(key)
    # Nothing is compiled for a round after the run's last step (lockstep.last_round).
    self._exchanges = programs.ahead(structs, last_round=lockstep.last_round(run.loop.round, run.loop.step,
                                                                             self._last, self._H))
    self._exchanges.prefetch(run.loop.round)
    if run.loop.inflight_step:  # resumed inside a window: the mean in flight is in the restored state
      self._pending, self.sent_at = None, run.loop.inflight_step

  @property
  def compile_stats(self):
    return self._exchanges.compiler.stats if self._exchanges is not None else None

  def _merge_due(self, step: int) -> bool:
    return self.sent_at > 0 and (step == self.sent_at + self.tau or step == self._last)

  def due(self, step: int) -> bool:
    return step % self._H == 0 or self._merge_due(step)

  def after_step(self, run, step: int, metrics: dict) -> None:
    if step % self._H == 0:
      self._send(run, step)
    if self._merge_due(step):
      self.settle(run)
      run.state = self._local.get("merge")(run.state)
      self._pending, self.sent_at, run.loop.inflight_step = None, 0, 0
      run.loop.round_applied(step)

  def _send(self, run, step: int) -> None:
    if self.sent_at:
      raise RuntimeError(f"step {step}: the exchange sent at step {self.sent_at} has not been merged.")
    # `sent`: (own, payload), or the payload alone when it is the own term (rounds.SplitPrograms).
    run.state, sent, round_metrics = self._local.get("message")(run.state)
    exchange_fn, route = self._exchanges.program(run.loop.round)  # also announces the next round's
    if self._executor is not None:
      self._pending = self._executor.submit(exchange_fn, *sent, route)
    else:
      self._pending = exchange_fn(*sent, route)
    self.sent_at = run.loop.inflight_step = step
    run.loop.add_round(step, round_metrics, self._traffic, applied=False)

  def settle(self, run) -> None:
    """Waits for the exchange in flight (if any) and puts its mean into the state's in-flight buffer."""
    if self._pending is None:  # nothing in flight, or its mean is in the state already (settled, restored)
      return
    if isinstance(self._pending, concurrent.futures.Future):
      self._pending = self._pending.result()  # re-raises the exchange's error on the loop's thread
    mean = jax.block_until_ready(self._pending)
    # Into the state where the buffer lives (pinned host memory with outer.offload): the merge program was
    # compiled for that layout. From now on the state holds it (and the inner steps donate it along).
    mean = jax.device_put(mean, self._home) if self._home is not None else mean
    run.state = run.state.replace(outer={**run.state.outer, methods.INFLIGHT: mean})
    self._pending = None

  def close(self, failed: bool) -> None:
    """`failed`: an exchange blocked on a partner that failed must not hold the error up."""
    if self._executor is not None:
      self._executor.shutdown(wait=not failed, cancel_futures=True)
    for compiler in (self._exchanges, self._local):
      if compiler is not None:
        compiler.close()
