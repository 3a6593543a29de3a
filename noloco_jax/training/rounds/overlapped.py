"""Streaming overlap: a round's exchange in flight while the next τ inner steps run (docs/method.md §13).

`outer.overlap.steps = τ > 0` (a method given in parts, any codec) runs the round of step tH as the
round layer's overlapped programs (outer/programs.RoundPrograms, where="exchange"):

- at step tH, **send**: the message program computes the round's message and its payload (a local
  program; the codec's error-feedback residual is updated here), then the exchange program forms the
  group mean, the only program that communicates. It reads the message alone, not the state, so the
  inner steps tH+1 … tH+τ, which donate the state, never wait for it;
- after step tH + τ, **merge**: φ, δ ← the method's rule with the arrived mean (exactly as without
  overlap) and θ ← λ·θ_local + (1 − λ)·φ (λ = `outer.overlap.mix`).

What actually runs concurrently was measured on XLA:CPU (experiments/bench_overlap.py, RESULTS.md): a
program with a cross-process collective executes inline in the thread that calls it, so the call
returns only when the exchange has finished, and the next program is dispatched after it. Neither
async dispatch nor one program holding both the exchange and independent compute overlapped them.
Calling the exchange program from a second host thread does: the main thread keeps dispatching inner
steps while the worker thread sits in the exchange. So with one local device per process on CPU
(`threaded`), the exchange is called on a one-thread executor (base.InFlight). Elsewhere (several local
devices, where XLA:CPU's gang-scheduled thread pool must not be shared with a pending collective, see
training/plugins/dispatch.py; or other backends, not measured) it is dispatched in order on the main thread:
the arithmetic is the same, only nothing is hidden.

`settle` (before evaluation, a job-wide log, the stop agreement, a checkpoint) waits for the exchange
and puts its group mean into the state's in-flight buffer (`base.INFLIGHT`, one float32 model copy
per replica, part of the method's state), which the merge reads. So the state has one shape whatever
is in flight, every checkpoint holds the mean in flight (the driver's record says whether one is), and a
run stopped inside a window resumes bitwise. At the run's last step an exchange still in flight is
merged there (after fewer than τ steps), so the final state includes every exchange sent.
"""

from __future__ import annotations

import jax

from noloco_jax.outer import base
from noloco_jax.outer import programs as programs_lib
from noloco_jax.training.rounds import lockstep
from noloco_jax.training.rounds.base import InFlight, RoundDriver


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
    self._programs = programs_lib.RoundPrograms(method, mesh, schedule, state_shardings, where="exchange", mix=mix)
    self._home = state_shardings.outer[base.INFLIGHT] if state_shardings is not None else None
    self.tau, self._last, self._every, self._traffic = tau, last_step, inner_steps, traffic
    self._stats = self._programs.stats
    self._inflight = InFlight(threaded, "overlap-exchange")
    self._started = False

  def start(self, run) -> None:
    super().start(run)  # resumed inside a window: the mean in flight is in the restored state
    # Nothing is compiled for a round after the run's last step (lockstep.last_round).
    self._programs.start(run.state, last_round=lockstep.last_round(run.loop.round, run.loop.step, self._last, self._every),
                         first_round=run.loop.round)
    self._started = True

  def save(self) -> dict:
    return self._inflight.record()

  def restore(self, record: dict) -> None:
    self._inflight.reopen(record)

  @property
  def sent_at(self) -> int:
    """The step whose exchange is in flight (0: none)."""
    return self._inflight.sent_at

  @property
  def compile_stats(self):
    return self._stats if self._started else None

  def _merge_due(self, step: int) -> bool:
    return self.sent_at > 0 and (step == self.sent_at + self.tau or step == self._last)

  def due(self, step: int) -> bool:
    return step % self._every == 0 or self._merge_due(step)

  def after_step(self, run, step: int, metrics: dict) -> None:
    if step % self._every == 0:
      compiled, route = self._programs.program(run.loop.round)  # also announces the next round's exchange
      # `sent`: (own, payload), or the payload alone when it is the own term (outer/programs.py).
      run.state, sent, round_metrics = compiled["message"](run.state)
      self._inflight.send(step, compiled["exchange"], *sent, route)
      run.loop.add_round(step, round_metrics, self._traffic, applied=False)
    if self._merge_due(step):
      self.settle(run)
      (merge,) = self._programs.get("merge")
      run.state = merge(run.state)
      self._inflight.clear()
      run.loop.round_applied(step)

  def settle(self, run) -> None:
    """Waits for the exchange in flight (if any) and puts its mean into the state's in-flight buffer."""
    if not self._inflight.pending:  # nothing in flight, or its mean is in the state already (settled, restored)
      return
    mean = jax.block_until_ready(self._inflight.result())  # re-raises the exchange's error on the loop's thread
    # Into the state where the buffer lives (pinned host memory with outer.offload): the merge program was
    # compiled for that layout. From now on the state holds it (and the inner steps donate it along).
    mean = jax.device_put(mean, self._home) if self._home is not None else mean
    run.state = run.state.replace(outer={**run.state.outer, base.INFLIGHT: mean})

  def close(self, failed: bool) -> None:
    self._inflight.close(failed)
    if self._started:
      self._programs.close()
