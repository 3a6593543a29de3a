"""Preemption: SIGTERM sets a flag; the loop reads it after every step, saves, and returns (main exits 0).

Single-process jobs read the flag after every step. Multi-process jobs agree on it every `sync_every`
steps with one all-gather of a 4-byte flag, so every process stops at the same step; the loop passes
its barrier steps (evaluations; log steps with log_barrier=True), so the agreement adds no barrier.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

_STOP = threading.Event()


def install_preemption_handler() -> None:
  """On SIGTERM, finish the current step, save, and return from the loop (main then exits 0)."""
  def on_sigterm(signum, frame):
    del signum, frame
    _STOP.set()  # Only set a flag: a signal handler must not touch JAX or the checkpoint manager.
  signal.signal(signal.SIGTERM, on_sigterm)


def stop_requested(step: int, sync_every: int) -> bool:
  """Whether to stop after `step`; the same answer on every process of a job."""
  if jax.process_count() == 1:
    return _STOP.is_set()
  if step % max(sync_every, 1):
    return False
  flags = multihost_utils.process_allgather(np.int32(_STOP.is_set()))
  return bool(np.max(flags))
