"""Non-finite values: no NaN is ever saved, and `nan_policy` decides what a NaN loss does.

No state is saved until the losses since the last log and the state itself are checked finite.
`config.nan_policy = "error"` stops the run at the first non-finite loss (naming the step and the
replica), leaving the last good checkpoint as it was. `"skip_round"`: see `RoundGuard`.
"""

from __future__ import annotations

import functools

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import failures
from noloco_jax.io.checkpoint import records
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib


# Each message says what to change; main.py prints it as the run's last line, with no traceback (it would
# only show the logging code), followed by the rerun the workdir allows (runtime/failures.py: resume
# from its last checkpoint, or start again where it holds none).


class NonFiniteLossError(failures.ReportedError, FloatingPointError):
  """A training loss is NaN or Inf (nan_policy="error")."""
  then_go_on = True


class NonFiniteStateError(failures.ReportedError, FloatingPointError):
  """The state holds NaN or Inf; raised instead of saving it."""
  then_go_on = True


class TooManySkippedRoundsError(failures.ReportedError, FloatingPointError):
  """nan_policy="skip_round" undid more consecutive rounds than config.nan_max_skipped_rounds."""
  then_go_on = True


def check_finite(losses_SxN: np.ndarray, steps: list[int], replica_ids: list[int] | None = None) -> None:
  """Raises NonFiniteLossError naming the first step and replica whose loss is NaN or Inf.

  `replica_ids`: the global index of each column, when the columns are one process's replicas.
  """
  bad = ~np.isfinite(losses_SxN)
  if bad.any():
    s, r = np.argwhere(bad)[0]
    r = r if replica_ids is None else replica_ids[r]
    raise NonFiniteLossError(
        f"non-finite training loss {losses_SxN[s, r]} at step {steps[s]} on replica {r} (nan_policy='error'). "
        "No state after the last finite checkpoint was saved; a resume with the same config replays the same "
        "steps, so first change what diverged (e.g. a lower inner.lr, longer inner.warmup_steps, inner.grad_clip) "
        "or set nan_policy='skip_round' to undo such rounds.")


@functools.cache
def _replica_finite_fn(mesh):
  """Jitted state → [N] bool, replicated so every process can read it: is replica r all finite?"""
  def finite(state):
    state = sharding_lib.device_view(state)  # φ, δ may live in host memory (outer.offload)
    ok = [jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
          for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, ok)
  return jax.jit(finite, out_shardings=mesh_lib.replicated(mesh))


def nonfinite_replicas(state: TrainState, mesh) -> list[int]:
  return [int(r) for r in np.flatnonzero(~np.asarray(_replica_finite_fn(mesh)(state)))]


class RoundGuard:
  """Undoes a round whose training loss or resulting state is not finite (`nan_policy="skip_round"`).

  A round is the window of H inner steps ending at a multiple of H (and the outer step there). The guard
  copies the state at the round's start (one more copy in device memory) and, after the outer step,
  fetches the round's losses and checks the state (one host round-trip per round). What a skip restores,
  keeps, logs and when it stops the run (TooManySkippedRoundsError): docs/running.md, "NaN policy".
  It exists only with that policy (training/rounds wraps the round driver in it). After resuming in the
  middle of a round (from a preemption save), a skip returns to the resumed state.
  """

  def __init__(self, inner_steps: int, max_in_a_row: int, mesh, history: dict | None = None):
    """`inner_steps`: H (a round ends every H steps); `max_in_a_row`: config.nan_max_skipped_rounds."""
    self._H, self._mesh = inner_steps, mesh
    self._max_in_a_row = max_in_a_row
    self._snapshot, self._losses, self._first = None, [], 0
    # Skips in a row carry over a resume: count the trailing skipped rounds that end one after another.
    self._in_a_row = 0
    skipped = (history or {}).get("skipped_rounds", [])
    for (_, last), nxt in zip(reversed(skipped), [None] + list(reversed(skipped))[:-1]):
      if nxt is not None and nxt[0] != last + 1:
        break
      self._in_a_row += 1

  def begin(self, step: int, state: TrainState) -> None:
    if self._snapshot is None or (step - 1) % self._H == 0:
      # A real copy, in the leaf's own memory space: the inner step donates `state`, and a copy
      # made inside jit could be forwarded instead of copied.
      self._snapshot = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
      self._losses, self._first = [], step

  def observe(self, loss_N) -> None:
    self._losses.append(loss_N)

  def end(self, step: int, state: TrainState, history: dict) -> TrainState:
    if step % self._H:
      return state
    losses = np.stack([records.host(x) for x in self._losses])
    bad_loss, bad_state = np.argwhere(~np.isfinite(losses)), nonfinite_replicas(state, self._mesh)
    snapshot, self._snapshot = self._snapshot, None
    if not len(bad_loss) and not bad_state:
      self._in_a_row = 0
      return state
    why = (f"loss {losses[tuple(bad_loss[0])]} at step {self._first + bad_loss[0][0]} on replica {bad_loss[0][1]}"
           if len(bad_loss) else f"non-finite state on replica(s) {bad_state}")
    self._in_a_row += 1
    if self._in_a_row > self._max_in_a_row:
      raise TooManySkippedRoundsError(
          f"nan_policy=skip_round: {self._in_a_row} rounds in a row diverged (the last: steps {self._first}-{step}, "
          f"{why}), more than nan_max_skipped_rounds={self._max_in_a_row}; the run is not training. Lower "
          "inner.lr or outer.rule.outer_lr (or raise nan_max_skipped_rounds).")
    logging.warning("nan_policy=skip_round: undoing the round of steps %d-%d (%s); training goes on from the "
                    "state at step %d with the next round's batches.", self._first, step, why, self._first - 1)
    history.setdefault("skipped_rounds", []).append([self._first, step])
    return snapshot
