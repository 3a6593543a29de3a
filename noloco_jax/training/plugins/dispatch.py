"""Bounded asynchronous dispatch: the host never runs more than a few steps ahead of the devices.

JAX dispatches a jitted call and returns at once; the loop could queue hundreds of steps before the
first one has run. On XLA:CPU with several devices, that deadlocks (issue 18, item 16):

- every program of the job spans all local devices, so the PjRt CPU client launches it "gang
  scheduled": one task per device, one program at a time, on ONE thread pool whose size is
  max(cores, devices) = 8 threads for 8 fake devices on a 2-core machine;
- a collective (the round's ppermute, DiLoCo's and DDP's all-reduce, the log-time all-gather) blocks
  each device's task in a rendezvous until the tasks of all 8 devices have arrived: it needs all 8
  threads at the same time;
- the client allows 32 computations in flight per device. When the host has queued that many, the
  NEXT call's per-device launch waits on that limit, and it waits on a thread of the same pool. One
  such waiter leaves 7 threads for the 8 participants of the collective now running: the 8th never
  starts, the collective never ends, so no computation completes and the waiter is never released.
  After 40 s XLA aborts: "Termination timeout for collective permute ... Expected 8 threads to join
  the rendezvous, but only 7 of them arrived on time" (seen under gdb: 7 pool threads in the
  rendezvous, the 8th in Semaphore::ScopedAcquire under CpuPjRtRawLoadedExecutable::Execute).

A round every step (H = 1) runs a collective in almost every window of 32 programs, so it aborted
within seconds; the default job (a round every 50 steps) only less often. The cause is the host
running ahead by 32 programs, so the fix bounds that: after each step the loop waits for the step
`depth` steps back. A few programs per step × `depth` stays far below the 32-per-device limit, and
the devices still always have the next step queued, so nothing is lost on any backend.
"""

from __future__ import annotations

import collections

import jax

# Steps (inner step + round + weight std: at most a handful of programs each) queued ahead of the one
# running. Two keep the devices busy while the host prepares the next batch; XLA:CPU's limit of 32
# programs in flight per device is then never reached, evaluation's batches (EVAL_CHUNK) included.
STEPS_IN_FLIGHT = 2
# Evaluation dispatches one program per validation batch: wait after every EVAL_CHUNK of them.
EVAL_CHUNK = 8


class DispatchWindow:
  """Keeps at most `depth` dispatched steps unfinished: push(marker) after each step's calls.

  `marker` is any array the step produced and nothing donates later (e.g. its per-replica losses):
  once it is ready, that step's programs have run, and with them every earlier program, since the
  client runs multi-device programs one at a time in dispatch order.
  """

  def __init__(self, depth: int = STEPS_IN_FLIGHT):
    if depth < 1:
      raise ValueError(f"DispatchWindow depth={depth} is not valid; it must be ≥ 1.")
    self.depth = depth
    self._queue: collections.deque = collections.deque()

  def push(self, marker) -> None:
    self._queue.append(marker)
    while len(self._queue) > self.depth:
      jax.block_until_ready(self._queue.popleft())
