"""Stop signals: SIGTERM saves and stops; SIGINT (Ctrl-C) stops, every time, with one line.

SIGTERM (preemption) sets a flag; the loop reads it after every step (`stop_requested`), saves, and
returns (main exits 0). Single-process jobs read the flag after every step. Multi-process jobs agree on
it every `sync_every` steps with one all-gather of a 4-byte flag, so every process stops at the same
step; the loop passes its barrier steps (evaluations; log steps with log_barrier=True), so the
agreement adds no barrier.

SIGINT raises KeyboardInterrupt as Python's own handler does, but Python's handler failed twice
(issue 25 item 4): raised inside XLA's garbage-collection callback, the exception was "ignored" and the
run trained on to the end, exit 0; raised inside orbax's save, it left an 85-line traceback and a
temporary checkpoint directory. So `install_preemption_handler` also installs a SIGINT handler that
counts the signal before it raises: `stop_requested` raises again if an interrupt was swallowed, and
inside `deferred_interrupts()` (the checkpointer's save and its wait for a save in flight) the
handler only counts, and the block raises when it ends, once the save is in a state a rerun can use.
main.py then ends with one `noloco_jax: error:` line and exit status 130 (runtime/failures.py).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

_STOP = threading.Event()


class _Interrupts:
  """SIGINTs received since the handler was installed, and whether they are being held back now."""
  count = 0
  deferred = 0  # depth of nested `deferred_interrupts` blocks


def install_preemption_handler() -> None:
  """SIGTERM: finish the current step, save, and return from the loop (main then exits 0).
  SIGINT: stop (see the module docstring), unless SIGINT was ignored when the process started."""
  def on_sigterm(signum, frame):
    del signum, frame
    _STOP.set()  # Only set a flag: a signal handler must not touch JAX or the checkpoint manager.
  signal.signal(signal.SIGTERM, on_sigterm)
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # e.g. `nohup ... &` ignores SIGINT: kept
    signal.signal(signal.SIGINT, _on_sigint)
    _quiet_swallowed_interrupts()


def _on_sigint(signum, frame):
  del signum, frame
  _Interrupts.count += 1
  if not _Interrupts.deferred:
    raise KeyboardInterrupt


def interrupted() -> int:
  """How many SIGINTs this process has received (0 without the handler)."""
  return _Interrupts.count


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
  """Holds SIGINT back for the block (it is counted, not raised), then raises KeyboardInterrupt once
  the block is done if one came. A no-op without the handler (notebooks, tests calling the loop)."""
  _Interrupts.deferred += 1
  try:
    yield
  finally:
    _Interrupts.deferred -= 1
  if _Interrupts.count and not _Interrupts.deferred and sys.exc_info()[0] is None:
    raise KeyboardInterrupt


def _quiet_swallowed_interrupts() -> None:
  """The `Exception ignored in ...: KeyboardInterrupt` report of an interrupt raised where Python cannot
  propagate it (a garbage-collection callback): dropped, since `stop_requested` raises it again."""
  previous = sys.unraisablehook
  if getattr(previous, "_noloco_interrupts", False):
    return

  def hook(unraisable):
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
      previous(unraisable)

  hook._noloco_interrupts = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def stop_requested(step: int, sync_every: int) -> bool:
  """Whether to stop after `step` (SIGTERM); the same answer on every process of a job. Raises
  KeyboardInterrupt if a SIGINT came and was swallowed where it was raised."""
  if _Interrupts.count and not _Interrupts.deferred:
    raise KeyboardInterrupt
  if jax.process_count() == 1:
    return _STOP.is_set()
  if step % max(sync_every, 1):
    return False
  flags = multihost_utils.process_allgather(np.int32(_STOP.is_set()))
  return bool(np.max(flags))
