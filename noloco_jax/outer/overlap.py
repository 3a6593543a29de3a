"""Streaming overlap: a round's exchange in flight while the next τ inner steps run (docs/method.md §13).

`outer.overlap_steps = τ > 0` (noloco, gossip with plain messages) cuts the round of step tH in two:

- at step tH, **send**: the message c = β·θ + (γ − β)·φ is computed (a local program), and its group
  mean is formed by a second program, the only one that communicates. That program reads c alone, not
  the state, so the inner steps tH+1 … tH+τ, which donate the state, never wait for it;
- after step tH + τ, **merge**: φ, δ ← the NoLoCo rule with the arrived mean (exactly as without
  overlap) and θ ← λ·θ_local + (1 − λ)·φ (λ = `outer.overlap_mix`).

What actually runs concurrently was measured on XLA:CPU (experiments/bench_overlap.py, RESULTS.md): a
program with a cross-process collective executes inline in the thread that calls it, so the call
returns only when the exchange has finished, and the next program is dispatched after it. Neither
async dispatch nor one program holding both the exchange and independent compute overlapped them.
Calling the send program from a second host thread does: the main thread keeps dispatching inner
steps while the worker thread sits in the exchange. So with one local device per process on CPU
(`threaded`), the send is called on a one-thread executor. Elsewhere (several local devices, where
XLA:CPU's gang-scheduled thread pool must not be shared with a pending collective, see
training/dispatch.py; or other backends, not measured) the send is dispatched in order on the main
thread: the arithmetic is the same, only nothing is hidden.

No other collective may start while the send is in flight (two processes could then enter their
collectives in different orders, which deadlocks): the loop calls `settle()` (wait for the exchange,
merge nothing) before evaluation, a job-wide log, the stop agreement and a checkpoint. At the run's
last step an exchange still in flight is merged there (after fewer than τ steps), so the final state
includes every exchange the run sent.

The in-flight mean (one float32 model copy per replica) is part of every checkpoint, as
`state.outer["inflight"]` (zeros when nothing is in flight; `LoopState.inflight_step` says which), so a
run stopped inside a window resumes bitwise.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from noloco_jax.inner.state import TrainState
from noloco_jax.outer import ahead as ahead_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA

INFLIGHT = "inflight"  # the key of the in-flight mean in a checkpointed state's `outer`


class Programs:
  """The three jitted programs of an overlapped round: message, send (one per grouping key), merge."""

  def __init__(self, method, mesh, schedule, state_shardings=None):
    rule = method.overlap
    if rule is None:
      raise ValueError(f"outer.kind={method.kind!r} has no overlapped round (noloco, gossip with plain messages do).")
    self._rule, self._mesh, self.schedule = rule, mesh, schedule
    self.state_shardings = state_shardings
    params_sh = state_shardings.params if state_shardings is not None else None
    device = sharding_lib.on_device(state_shardings.outer) if state_shardings is not None else None
    home = state_shardings.outer if state_shardings is not None else None
    replicas = mesh_lib.replica_sharding(mesh)

    message_local = mesh_lib.replica_map(rule.message, mesh, in_specs=(P(REPLICA),), out_specs=(P(REPLICA), P(REPLICA)))
    merge_local = mesh_lib.replica_map(rule.merge, mesh, in_specs=(P(REPLICA), P(REPLICA)), out_specs=P(REPLICA))

    def message(state: TrainState):
      # φ may live in host memory (outer.offload): read it on the device, as the plain round does.
      if device is not None:
        state = state.replace(outer=jax.device_put(state.outer, device))
      return message_local(state)

    def merge(state: TrainState, mean_c):
      if device is not None:
        state = state.replace(outer=jax.device_put(state.outer, device))
      state = merge_local(state, mean_c)
      return state.replace(outer=jax.device_put(state.outer, home)) if home is not None else state

    # No donation in `message`: the next inner step takes the state. `merge` donates the state (the
    # arrived mean has no output of its kind to alias); with explicit shardings the state leaves laid
    # out as it came (no reshard).
    self.message = jax.jit(message, out_shardings=(params_sh, replicas) if params_sh is not None else None)
    self.merge = jax.jit(merge, donate_argnums=0,
                         out_shardings=state_shardings if state_shardings is not None else None)
    self._params_sh = params_sh
    self.zeros = jax.jit(lambda params: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                         out_shardings=params_sh)

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(program key, route) of round `round_`, as outer/rounds.Rounds.plan."""
    return self.schedule.plan(round_, self._mesh.shape[REPLICA])

  def build_send(self, key) -> Callable:
    """jitted (c [N, ...] float32, route) -> mean_G(c) for the groupings of `key`; donates c."""
    send_local = self._rule.make_send(key, self._mesh.shape[REPLICA])
    sharded = mesh_lib.replica_map(send_local, self._mesh, in_specs=(P(REPLICA), P()), out_specs=P(REPLICA))
    return jax.jit(sharded, donate_argnums=0, out_shardings=self._params_sh)

  def ahead(self, state: TrainState) -> ahead_lib.RoundPrograms:
    """Send programs compiled one round ahead (outer/ahead.py), for the message's shapes and layout."""
    abstract_c = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), state.params)
    return ahead_lib.RoundPrograms(self.plan, self.build_send, abstract_c, self.schedule,
                                   mesh_lib.replicated(self._mesh))


def threaded_send_is_safe(config) -> bool:
  """Whether the send may run on a second host thread: measured safe and useful only on XLA:CPU with one
  local device per process, with inner steps that hold no collective (no fsdp, no pipeline stages)."""
  return (jax.default_backend() == "cpu" and jax.process_count() > 1 and jax.local_device_count() == 1
          and config.fsdp == 1 and config.num_stages == 1)


class Exchanges:
  """The loop's overlapped rounds: `send` after step tH, `merge` after step tH + τ (module doc)."""

  def __init__(self, programs: Programs, state: TrainState, tau: int, threaded: bool):
    self.programs, self.tau = programs, tau
    self.sends = programs.ahead(state)
    # The message and merge programs compile in the background from the start, like the round programs
    # (outer/ahead.py): otherwise the first merge would wait for a compile (seen: 3 s on a loaded CPU).
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    abstract_c = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), state.params)
    lower = {"message": lambda: programs.message.lower(abstract), "merge": lambda: programs.merge.lower(abstract, abstract_c)}
    self._local = ahead_lib.AheadCompiler(lambda key: lower[key](), capacity=2)
    for key in lower:
      self._local.prefetch(key)
    self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-send")
                      if threaded else None)
    self._pending = None  # a Future, or the mean itself (dispatched inline, or restored)
    self.sent_at = 0  # the step whose exchange is in flight (0: none)

  @property
  def in_flight(self) -> bool:
    return self.sent_at > 0

  def prefetch(self, round_: int) -> None:
    self.sends.prefetch(round_)

  def send(self, state: TrainState, round_: int, step: int) -> dict:
    """Computes round `round_`'s message from `state` and starts its exchange; returns the round's metrics."""
    if self.in_flight:
      raise RuntimeError(f"step {step}: the exchange sent at step {self.sent_at} has not been merged.")
    c, metrics = self._local.get("message")(state)
    send_fn, route = self.sends.program(round_)  # also announces round_ + 1's program
    if self._executor is not None:
      self._pending = self._executor.submit(send_fn, c, route)
    else:
      self._pending = send_fn(c, route)
    self.sent_at = step
    return metrics

  def merge_due(self, step: int, last_step: int) -> bool:
    return self.in_flight and (step == self.sent_at + self.tau or step == last_step)

  def settle(self) -> None:
    """Waits until the exchange in flight (if any) has completed; merges nothing."""
    if self.in_flight:
      jax.block_until_ready(self._mean())

  def merge(self, state: TrainState) -> TrainState:
    """Applies the arrived group mean to `state` (the rule and the mix); nothing is in flight after."""
    state = self._local.get("merge")(state, self._mean())
    self._pending, self.sent_at = None, 0
    return state

  def _mean(self):
    if isinstance(self._pending, concurrent.futures.Future):
      self._pending = self._pending.result()  # re-raises the send's error on the loop's thread
    return self._pending

  # ---- Checkpoints: the in-flight mean travels in state.outer["inflight"] ----

  def for_checkpoint(self, state: TrainState) -> TrainState:
    """`state` with the in-flight mean (zeros when none) under outer["inflight"]; waits for the exchange."""
    mean = self._mean() if self.in_flight else self.programs.zeros(state.params)
    return state.replace(outer={**state.outer, INFLIGHT: mean})

  def from_checkpoint(self, state: TrainState, sent_at: int) -> TrainState:
    """The restored state without the buffer; the buffer is the mean in flight when `sent_at` > 0."""
    outer = dict(state.outer)
    mean = outer.pop(INFLIGHT)
    self._pending, self.sent_at = (mean, sent_at) if sent_at else (None, 0)
    return state.replace(outer=outer)

  def close(self, wait: bool = True) -> None:
    """`wait=False` on an error path: a send blocked on a partner that failed must not hold the error up."""
    if self._executor is not None:
      self._executor.shutdown(wait=wait, cancel_futures=True)
    self.sends.close()
    self._local.close()
