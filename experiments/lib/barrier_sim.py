"""Barriers on a concrete setting: the model that experiments/bench_network.py puts beside its measurement.

experiments/lib/latency.py §5 asks what barriers cost on average over random step times. This module answers
the same question for ONE setting, the one a benchmark ran: its per-process compute times (a
persistent straggler, or the very log-normal draws NOLOCO_FAULTS made), its actual seeded groupings,
and an α–β exchange whose bytes go through one shared link. Re-exported by experiments/lib/latency.py (section 8).

The model. Barrier b (an outer round, or for DDP an inner step) is a barrier within each of its groups
only. Process q computes c[b, q] after it left barrier b − 1; its group g is ready when its last member
is:  ready(b, g) = max over q in g of (finish_q(b − 1) + c[b, q]).  The group then exchanges:
    finish(b, g) = max(ready(b, g), link free) + bytes_g·β + α,
with `link free` the time the shared link has sent everything queued before (a FIFO server: one `tbf`
qdisc on loopback is one queue for every flow of the job). A token bucket of `burst` bytes (tbf's
burst) lets that many bytes through at once after the link was idle: tokens refill at 1/β bytes per
second up to `burst`, and an exchange of B bytes finding k tokens takes max(B − k, 0)·β. With β = 0
the link never queues and an exchange costs α. Every member of g leaves at finish(b, g), so a process held up by a slow partner
starts its next barrier late and holds up its next partner in turn: the lag is carried through the
groupings. With one group of everyone per barrier this is the global barrier (DiLoCo, DDP).

Idle fraction of q = Σ_b (finish(b, g) − finish_q(b − 1) − c[b, q]) / Σ_b (finish(b, g) − finish_q(b − 1))
over the counted barriers (from `first`): the exchange itself counts as idle, as in the benchmark,
where the time in an outer round is its "wait".

Pure NumPy functions of their arguments (tests/test_latency.py checks them by hand-computed schedules).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from experiments.lib.alpha_beta import bytes_sent_per_replica_per_round

Groups = Sequence[Sequence[int]]


def straggler_step_times(processes: int, steps: int, step_s: float, factor: float, straggler: int = 0) -> np.ndarray:
  """[steps, P] compute seconds per step: `step_s` everywhere, `factor` × as long on `straggler`."""
  if processes < 1 or steps < 0 or step_s < 0 or factor <= 0:
    raise ValueError(f"need processes >= 1, steps >= 0, step_s >= 0, factor > 0; got {processes}, {steps}, "
                     f"{step_s}, {factor}")
  times = np.full((steps, processes), float(step_s))
  times[:, straggler] *= factor
  return times


def lognormal_step_times(processes: int, steps: int, median: float, sigma: float, seed: int) -> np.ndarray:
  """[steps, P] seconds: the draws NOLOCO_FAULTS `lognormal:median=…,sigma=…,seed=…` makes.

  Process p draws from numpy's default_rng(seed + p), one standard normal z per step in step order,
  and sleeps median·exp(σ·z) (runtime/faults.py): the same numbers, so the model sees the delays the
  run slept, not another sample of their distribution.
  """
  out = np.empty((steps, processes))
  for p in range(processes):
    out[:, p] = median * np.exp(sigma * np.random.default_rng(int(seed) + p).standard_normal(steps))
  return out


def per_barrier(step_times: np.ndarray, steps_per_barrier: int) -> np.ndarray:
  """[B, P] compute before each barrier: the step times summed over each run of `steps_per_barrier`
  steps (a trailing partial run has no barrier and is dropped)."""
  b = step_times.shape[0] // steps_per_barrier
  return step_times[:b * steps_per_barrier].reshape(b, steps_per_barrier, -1).sum(axis=1)


def link_bytes(method: str, group_size: int, s_bytes: float) -> float:
  """Bytes one group's exchange puts through the shared link: every member sends its share.

  pair: each of the 2 members sends one copy S (2·S); ring all-reduce of n: n · 2(n − 1)/n · S =
  2(n − 1)·S (alpha_beta.bytes_sent_per_replica_per_round: noloco_jax/outer/wire.py's bytes sent).
  """
  return group_size * bytes_sent_per_replica_per_round(method, group_size, s_bytes)


def barrier_schedule(groups_by_barrier: Sequence[Groups], compute: np.ndarray, *, alpha: float = 0.0,
                     beta: float = 0.0, bytes_by_group_size=None, burst_bytes: float = 0.0,
                     first: int = 1, exchange_s=None, hidden_s: np.ndarray | None = None) -> dict:
  """Finish times, idle fractions and time per barrier of the model above.

  groups_by_barrier[b]: barrier b's groups (lists of process indices covering every process);
  compute: [B, P] seconds; alpha: s per exchange; beta: s per byte of the shared link;
  bytes_by_group_size(n): bytes one group of n puts through the link (needed when beta > 0);
  burst_bytes: the link's token bucket (full at time 0);
  first: barriers before it set the clocks but are not counted (the benchmark leaves its first,
  compiling round out too).
  exchange_s(group): instead of the shared link, seconds of a group's exchange on links of its own
  (per-node links: latency.per_node_exchange_s); groups never queue behind each other.
  hidden_s [B, P]: seconds of member q's compute after barrier b that run while b's exchange is in flight
  (the lock-step overlapped round, outer.overlap_steps τ: the first τ steps of the next round): q then
  leaves b at ready + max(exchange − hidden_s[b, q], 0).
  Returns idle_fraction [P], wall_s_per_barrier (the slowest process's time over the counted barriers
  / their number), wait_s and busy_s [P] (counted barriers) and finish [B, P].
  """
  compute = np.asarray(compute, np.float64)
  num_barriers, processes = compute.shape
  if len(groups_by_barrier) < num_barriers:
    raise ValueError(f"{len(groups_by_barrier)} groupings for {num_barriers} barriers")
  if not 0 <= first < num_barriers:
    raise ValueError(f"first={first} must be in [0, {num_barriers})")
  if beta > 0 and bytes_by_group_size is None:
    raise ValueError("beta > 0 needs bytes_by_group_size")
  if beta > 0 and exchange_s is not None:
    raise ValueError("beta (one shared link) and exchange_s (links of their own) exclude each other")
  finish = np.zeros((num_barriers, processes))
  left = np.zeros(processes)  # when each process left its previous barrier
  # Groups become ready in time order (a group's ready time is at least the finish that made it
  # known), so a heap of known groups serves the shared link first come, first served.
  members_left = [[len(g) for g in groups_by_barrier[b]] for b in range(num_barriers)]
  group_of = [{q: i for i, g in enumerate(groups_by_barrier[b]) for q in g} for b in range(num_barriers)]
  for b in range(num_barriers):
    if sorted(group_of[b]) != list(range(processes)):
      raise ValueError(f"barrier {b}: groups {groups_by_barrier[b]} do not cover processes 0..{processes - 1} once")
  ready_at = [np.zeros(len(g)) for g in groups_by_barrier[:num_barriers]]
  heap: list = []

  def arrive(q: int, b: int) -> None:
    g = group_of[b][q]
    ready_at[b][g] = max(ready_at[b][g], left[q] + compute[b, q])
    members_left[b][g] -= 1
    if members_left[b][g] == 0:
      heapq.heappush(heap, (ready_at[b][g], b, g))

  for q in range(processes):
    arrive(q, 0)
  link_free, tokens = 0.0, float(burst_bytes)  # tokens: the bucket's content at time link_free
  while heap:
    ready, b, g = heapq.heappop(heap)
    group = groups_by_barrier[b][g]
    sent = ready
    if exchange_s is not None:
      sent = ready + exchange_s(tuple(group))
    elif beta > 0:
      start = max(ready, link_free)
      tokens = min(burst_bytes, tokens + (start - link_free) / beta)
      size = bytes_by_group_size(len(group))
      link_free = start + max(size - tokens, 0.0) * beta
      tokens = max(tokens - size, 0.0)
      sent = link_free
    end = sent + alpha
    for q in group:
      # With the round in flight beside the next steps, q waits only for what they did not cover.
      own = end if hidden_s is None else ready + max(end - ready - hidden_s[b, q], 0.0)
      finish[b, q] = own
      left[q] = own
      if b + 1 < num_barriers:
        arrive(q, b + 1)
  counted = slice(first, num_barriers)
  before = np.vstack([np.zeros((1, processes)), finish[:-1]])  # when each barrier's compute began
  span = finish - before
  wait = np.maximum((span - compute)[counted].sum(axis=0), 0.0)  # no −1e-16 from rounding
  busy = compute[counted].sum(axis=0)
  start = finish[first - 1] if first > 0 else np.zeros(processes)
  wall = float(np.max(finish[-1] - start)) / (num_barriers - first)
  return {"idle_fraction": [float(x) for x in wait / (wait + busy)], "wall_s_per_barrier": wall,
          "wait_s": wait.tolist(), "busy_s": busy.tolist(), "finish": finish}
