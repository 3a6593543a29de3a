"""Latency and α–β communication models for NoLoCo vs all-reduce (docs/method.md §6).

Why this module exists: NoLoCo's claim is that replacing the global all-reduce of DiLoCo by an exchange
inside random pairs saves wall time, because (1) a pair exchange has a constant number of messages
where a tree all-reduce has 2·log2(N) in sequence, (2) with variable message times a tree waits for
its slowest branch, and (3) there is no global barrier, so a worker never waits for the slowest of all
N workers. None of that is about bytes: a lean pair exchange moves one model copy each way per round,
a ring all-reduce about two. These functions make each of those statements a number that can be
checked, so that the figures quoted in experiments/RESULTS.md are reproducible and their regime
(latency-bound or bandwidth-bound) is explicit.

Model sizes come from the model interface (noloco_jax/models/); everything else is plain NumPy. Every
Monte Carlo function takes a `seed` (an int
or a tuple of ints) and builds its own generator, so a call is a pure function of its arguments.

Units: in the latency and barrier models time is in units of the mean message time t (or the mean
inner-step time); in the α–β model, seconds, bytes and bits per second.

Sections, in order:
  1. Model sizes and 6. the α–β cost model: experiments/lib/alpha_beta.py (re-exported here).
  2. Log-normal message times parameterised by mean and standard deviation.
  3. Latency model with constant message times (closed forms).
  4. Latency model with log-normal message times (Monte Carlo): tree, ring, pair.
  5. Global barrier vs pair barrier with noisy inner-step times (Monte Carlo).
  7. `summary`: every headline figure in one dict (used by experiments/latency_model.py).
  8. Barriers on one concrete setting (a straggler or seeded per-step delays, the run's own
     groupings, a shared-bucket link): experiments/lib/barrier_sim.py, re-exported here; the model column
     of experiments/bench_network.py.
  9. The asynchronous schedule on one setting (`async_schedule`): no barrier at all; the pairing law of
     noloco_jax/asynchronous/law.py decides who meets whom and when; the model column of
     bench_network.py's async runs.
 10. Per-node links (`per_node_exchange_s`): every process on a link of its own with its own up and down
     rate (experiments/lib/node_links.py), so an exchange's time is set by its own members' links and does
     not grow with P; what a message weighs comes from the run's accounting (noloco_jax/outer/wire.py),
     so a codec's payload is priced as it is sent.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# Re-exported, so that `latency` stays the study's one entry point (tests, experiments/latency_model.py).
from experiments.lib.alpha_beta import (  # noqa: F401
    BYTES_PER_PARAM, PAPER_MODELS, PAPER_SEQ_LEN, PAPER_VOCAB_SIZE, alpha_beta_table,
    bytes_sent_per_replica_per_round, latency_share, model_bytes, pair_exchange_alpha_beta,
    pair_exchange_reference_alpha_beta, paper_model_params, ring_allreduce_alpha_beta, seconds_per_byte,
    tree_allreduce_alpha_beta)
from experiments.lib.barrier_sim import (  # noqa: F401
    barrier_schedule, link_bytes, lognormal_step_times, per_barrier, straggler_step_times)
from noloco_jax.asynchronous import law

# ----------------------------------------------------------------------------------------------------
# 2. Log-normal message times
# ----------------------------------------------------------------------------------------------------


def lognormal_params(mean: float, std: float) -> tuple[float, float]:
  """(mu, sigma) of the underlying normal so that exp(N(mu, sigma²)) has the given mean and std.

  Parameterising by mean and std (not mu and sigma) keeps the mean message time at t whatever the
  spread, so any growth of the tree's time with the spread is due to waiting on slow messages and not
  to a larger average message. sigma² = ln(1 + (std/mean)²), mu = ln(mean) − sigma²/2.
  """
  if mean <= 0 or std < 0:
    raise ValueError(f"need mean > 0 and std >= 0, got mean={mean}, std={std}")
  sigma2 = math.log1p((std / mean) ** 2)
  return math.log(mean) - sigma2 / 2, math.sqrt(sigma2)


def sample_lognormal(rng: np.random.Generator, mean: float, std: float, shape) -> np.ndarray:
  """Log-normal draws with the given mean and std (std = 0 gives the constant `mean`)."""
  mu, sigma = lognormal_params(mean, std)
  if sigma == 0.0:
    return np.full(shape, mean, dtype=np.float64)
  return np.exp(mu + sigma * rng.standard_normal(shape))


def _rng(seed) -> np.random.Generator:
  """A fresh generator from an int or a tuple of ints (so (seed, N) streams are independent)."""
  return np.random.default_rng(seed)


def _check_power_of_two(n: int) -> int:
  """log2(n) for a power of two n >= 1; the tree models need a complete binary tree."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"N must be a power of two, got {n}")
  return n.bit_length() - 1


# ----------------------------------------------------------------------------------------------------
# 3. Latency model, constant message time t
# ----------------------------------------------------------------------------------------------------
# Every message takes t whatever its size (the latency-bound limit). A tree all-reduce reduces up a
# binary tree (log2 N levels) and broadcasts back down (log2 N levels): 2·t·log2 N. A ring all-reduce
# has 2(N−1) steps in sequence (reduce-scatter then all-gather): 2·t·(N−1). NoLoCo's pair exchange is
# the same reduce-and-broadcast inside a group of two: 2·t, as in the paper, so that the pair is
# exactly the tree at N = 2. (A single simultaneous swap of the two copies would take t; see
# `simulate_pair_exchange`.)


def tree_allreduce_time_constant(n: int, t: float = 1.0) -> float:
  """Binary-tree all-reduce with constant message time t: 2·t·log2(N)."""
  return 2.0 * t * _check_power_of_two(n)


def ring_allreduce_time_constant(n: int, t: float = 1.0) -> float:
  """Ring all-reduce with constant message time t: 2·(N−1) sequential steps."""
  return 2.0 * t * (n - 1)


def pair_exchange_time_constant(t: float = 1.0) -> float:
  """NoLoCo pair exchange (reduce to the pair and send back) with constant message time t: 2·t."""
  return 2.0 * t


def constant_speedup(n: int) -> float:
  """Tree all-reduce over pair exchange with constant message times: log2(N) (10 at N = 1024)."""
  return tree_allreduce_time_constant(n) / pair_exchange_time_constant()


# ----------------------------------------------------------------------------------------------------
# 4. Latency model, log-normal message times (Monte Carlo)
# ----------------------------------------------------------------------------------------------------
# Precise model ("a parent waits for its slower child"): every message has its own independent
# log-normal time with mean t and std `std`.
#  * Tree all-reduce over N = 2^k workers (the leaves of a complete binary tree of combine points).
#    Reduce: each of the two children of a combine point sends its partial sum, which arrives at
#    (child ready) + (its message time); the parent has its sum when the slower of the two arrives:
#        ready(parent) = max(ready(a) + X_a, ready(b) + X_b).
#    Broadcast: each child receives the result from its parent: ready(child) = ready(parent) + X_child.
#    The all-reduce is done when the last worker has the result (every worker waits for it: it is a
#    barrier). With X ≡ t this is exactly 2·t·log2 N.
#  * Pair exchange (NoLoCo, primary definition): the same protocol with N = 2, i.e.
#    max(X1, X2) + max(X3, X4) — both members send, the combination waits for the slower, and both
#    receive, the pair waits for the slower. With X ≡ t it is 2·t. Pairs do not wait for each other,
#    so the figure of merit is the expected time of one pair, not the slowest of the N/2 pairs.
#    Two variants are reported for sensitivity: "relay" X1 + X2 (the reference code: the non-root
#    member sends to the root member, which sends the result back; mean exactly 2t) and "swap"
#    max(X1, X2) (one simultaneous exchange of copies in both directions; t when constant).
#  * Ring all-reduce: 2(N−1) steps; at step k worker i receives a chunk from worker i−1, which could
#    send it once it had finished step k−1; worker i finishes step k when it has finished step k−1 and
#    that chunk has arrived:  T_i(k) = max(T_i(k−1), T_{i−1}(k−1) + X_{i,k}).  Done at max_i T_i.
#    With X ≡ t this is 2·t·(N−1).


def simulate_tree_allreduce(n: int, std: float, trials: int, seed, mean: float = 1.0) -> np.ndarray:
  """Monte Carlo times (one per trial) of a binary-tree all-reduce over N workers; see the model above."""
  levels = _check_power_of_two(n)
  rng = _rng(seed)
  ready = np.zeros((trials, n))
  for _ in range(levels):  # reduce: pairs of siblings -> parent, the slower message decides
    arrive = ready + sample_lognormal(rng, mean, std, ready.shape)
    ready = arrive.reshape(trials, -1, 2).max(axis=-1)
  for _ in range(levels):  # broadcast: parent -> each of its two children, each with its own message
    ready = np.repeat(ready, 2, axis=1)
    ready = ready + sample_lognormal(rng, mean, std, ready.shape)
  return ready.max(axis=1)


def simulate_pair_exchange(std: float, trials: int, seed, mean: float = 1.0,
                           variant: str = "tree") -> np.ndarray:
  """Monte Carlo times of one NoLoCo pair exchange.

  variant "tree":  max(X1, X2) + max(X3, X4)   (the tree protocol at N = 2; primary; 2t if constant)
  variant "relay": X1 + X2                      (to the root member and back; reference code; 2t)
  variant "swap":  max(X1, X2)                  (one simultaneous two-way swap; t if constant)
  """
  rng = _rng(seed)
  x = sample_lognormal(rng, mean, std, (trials, 4))
  if variant == "tree":
    return np.maximum(x[:, 0], x[:, 1]) + np.maximum(x[:, 2], x[:, 3])
  if variant == "relay":
    return x[:, 0] + x[:, 1]
  if variant == "swap":
    return np.maximum(x[:, 0], x[:, 1])
  raise ValueError(f"unknown pair-exchange variant {variant!r}")


def simulate_ring_allreduce(n: int, std: float, trials: int, seed, mean: float = 1.0) -> np.ndarray:
  """Monte Carlo times of a ring all-reduce over N workers (2(N−1) dependent steps; see above)."""
  rng = _rng(seed)
  done = np.zeros((trials, n))
  for _ in range(2 * (n - 1)):
    from_left = np.roll(done, 1, axis=1) + sample_lognormal(rng, mean, std, done.shape)
    done = np.maximum(done, from_left)
  return done.max(axis=1)


def mean_and_sem(samples: np.ndarray) -> tuple[float, float]:
  """Sample mean and its standard error (0 for a single sample)."""
  samples = np.asarray(samples, dtype=np.float64)
  sem = samples.std(ddof=1) / math.sqrt(samples.size) if samples.size > 1 else 0.0
  return float(samples.mean()), float(sem)


# ----------------------------------------------------------------------------------------------------
# 5. The cost of a global barrier with noisy inner-step times
# ----------------------------------------------------------------------------------------------------
# Each worker runs H inner steps per round; step times are i.i.d. log-normal with mean 1 and std `cv`
# (so time is in units of the mean step time, and a round takes H on average). A worker's compute time
# for a round is W = sum of its H step times. Communication time is left out: this isolates waiting.
#  * DiLoCo: the all-reduce is a global barrier, so every round lasts max over all N workers of W.
#  * NoLoCo, decoupled model: each round lasts max of the pair's two W (pairs never wait for others).
#    This is the simple per-round comparison; it overstates NoLoCo's advantage, because a worker held
#    up by a slow partner starts its next round late and then holds up its next partner.
#  * NoLoCo, coupled model: the real dependency structure. With pairs re-drawn every round (a fresh
#    random perfect matching, as in the code), worker i's next round starts at
#        start_i(r+1) = max(start_i(r) + W_i(r), start_p(r) + W_p(r)),  p = i's partner in round r,
#    and we measure the long-run time per round. Delays spread through the random pairings, so this
#    rate lies between E[max of 2] and E[max of N]; for large N it stops growing with N (it behaves
#    like a branching random walk), while DiLoCo's keeps growing like sqrt(2 ln N) standard deviations.
# Extra wall time of DiLoCo over NoLoCo = (DiLoCo time per round) / (NoLoCo time per round) − 1.


def simulate_round_compute_times(n: int, h: int, cv: float, trials: int, seed) -> np.ndarray:
  """(trials, N) array of per-worker round times W: sums of H log-normal step times (mean 1, std cv)."""
  rng = _rng(seed)
  w = np.zeros((trials, n))
  for _ in range(h):  # accumulate step by step: memory stays at (trials, N)
    w += sample_lognormal(rng, 1.0, cv, (trials, n))
  return w


def barrier_extra_decoupled(round_times: np.ndarray) -> dict:
  """Per-round waiting, decoupled model: global max over N vs max within consecutive pairs.

  `round_times` is (trials, N) from `simulate_round_compute_times`. Pairs are workers (0,1), (2,3), …
  (the draws are i.i.d., so any fixed matching is a random matching). Because in every trial the
  maximum over all N is at least every pair's maximum, the extra time is >= 0 by construction.
  """
  trials, n = round_times.shape
  global_round = float(round_times.max(axis=1).mean())
  pair_round = float(round_times.reshape(trials, n // 2, 2).max(axis=2).mean())
  return dict(diloco_round=global_round, noloco_round=pair_round,
              extra=global_round / pair_round - 1.0)


def barrier_extra_by_n(round_times: np.ndarray, ns: Sequence[int]) -> list[float]:
  """Decoupled extra time for each N in `ns`, using the first N workers of the same draws."""
  return [barrier_extra_decoupled(round_times[:, :n])["extra"] for n in ns]


def simulate_barrier_coupled(n: int, h: int, cv: float, rounds: int, trials: int, seed) -> dict:
  """Long-run time per round of DiLoCo (global barrier) and NoLoCo (random pairs, coupled model).

  Both methods see the same step-time draws. The rate is the slope of the mean start time over the
  second half of the rounds, which drops the start-up transient (delays need about log2 N rounds
  to spread through the random pairings).
  """
  rng = _rng(seed)
  pair_rng = _rng((*np.atleast_1d(seed).tolist(), 7919))  # the matchings: separate stream
  start_pair = np.zeros((trials, n))
  start_global = np.zeros(trials)
  history_pair, history_global = [0.0], [0.0]
  for _ in range(rounds):
    w = np.zeros((trials, n))
    for _ in range(h):
      w += sample_lognormal(rng, 1.0, cv, (trials, n))
    finish = start_pair + w
    matching = pair_rng.permutation(n).reshape(-1, 2)
    both = np.maximum(finish[:, matching[:, 0]], finish[:, matching[:, 1]])
    start_pair[:, matching[:, 0]] = both
    start_pair[:, matching[:, 1]] = both
    start_global = (start_global[:, None] + w).max(axis=1)
    history_pair.append(float(start_pair.mean()))
    history_global.append(float(start_global.mean()))
  half = rounds // 2
  span = rounds - half
  noloco = (history_pair[rounds] - history_pair[half]) / span
  diloco = (history_global[rounds] - history_global[half]) / span
  return dict(diloco_round=diloco, noloco_round=noloco, extra=diloco / noloco - 1.0)


def step_cv_for_extra(sweep: Sequence[dict], key: str, target: float) -> float | None:
  """Step-time spread at which the extra time `key` reaches `target`, interpolated in a sweep.

  Used to say which step-time distribution the paper's "≈20%" corresponds to. The extra time grows
  monotonically with the spread; returns None when `target` lies outside the swept range.
  """
  extras = [row[key] for row in sweep]
  if not extras or not min(extras) <= target <= max(extras):
    return None
  order = np.argsort(extras)
  return float(np.interp(target, np.asarray(extras)[order],
                         np.asarray([row["step_cv"] for row in sweep])[order]))


# ----------------------------------------------------------------------------------------------------
# 7. Everything at once
# ----------------------------------------------------------------------------------------------------


def summary(ns: Sequence[int] = tuple(2 ** k for k in range(1, 13)), key_n: int = 1024,
            std: float = 2.5, trials: int = 1000, ring_trials: int = 2, ring_max_n: int = 4096,
            h: int = 100, step_cv: float = 0.5, cv_sweep: Sequence[float] = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0),
            barrier_trials: int = 20, barrier_rounds: int = 32, barrier_coupled_trials: int = 2,
            alpha: float = 1e-3, link_bps: Sequence[float] = (100e6, 1e9),
            ab_ns: Sequence[int] = (16, 64, 1024), seed: int = 0) -> dict:
  """All figures of experiments/latency_model.py as a JSON-ready dict (seeded; see the sections above).

  Seeds: each (experiment, N) pair gets its own stream (seed, tag, N), so changing the list of N does
  not change the figure at a given N.
  """
  if key_n not in ns:
    raise ValueError(f"key_n={key_n} must be one of ns")
  out: dict = dict(seed=seed, ns=list(ns), key_n=key_n)

  # Parameter counts and bytes.
  out["params"] = {name: paper_model_params(name) for name in PAPER_MODELS}

  # Latency model, constant t.
  out["constant"] = dict(
      tree=[tree_allreduce_time_constant(n) for n in ns],
      ring=[ring_allreduce_time_constant(n) for n in ns],
      pair=pair_exchange_time_constant(),
      speedup_at_key_n=constant_speedup(key_n),
  )

  # Latency model, log-normal message times.
  tree = [mean_and_sem(simulate_tree_allreduce(n, std, trials, (seed, 1, n))) for n in ns]
  ring_ns = [n for n in ns if n <= ring_max_n]
  ring = [mean_and_sem(simulate_ring_allreduce(n, std, ring_trials, (seed, 2, n))) for n in ring_ns]
  pair_trials = max(trials, 100_000)  # cheap, and it is the denominator of every ratio
  pairs = {v: mean_and_sem(simulate_pair_exchange(std, pair_trials, (seed, 3), variant=v))
           for v in ("tree", "relay", "swap")}
  tree_key = tree[list(ns).index(key_n)][0]
  out["lognormal"] = dict(
      std_over_t=std, trials=trials, ring_trials=ring_trials,
      tree_mean=[m for m, _ in tree], tree_sem=[e for _, e in tree],
      ring_ns=ring_ns, ring_mean=[m for m, _ in ring], ring_sem=[e for _, e in ring],
      pair_mean=pairs["tree"][0], pair_sem=pairs["tree"][1],
      pair_relay_mean=pairs["relay"][0], pair_swap_mean=pairs["swap"][0],
      ratio_at_key_n=tree_key / pairs["tree"][0],
      ratio_at_key_n_vs_relay=tree_key / pairs["relay"][0],
      ratio_at_key_n_vs_swap=tree_key / pairs["swap"][0],
  )

  # Global barrier vs pair barrier.
  w = simulate_round_compute_times(max(ns), h, step_cv, barrier_trials, (seed, 4))
  decoupled = barrier_extra_decoupled(w[:, :key_n])
  coupled = simulate_barrier_coupled(key_n, h, step_cv, barrier_rounds, barrier_coupled_trials, (seed, 5))
  sweep = []
  for cv in cv_sweep:
    wc = simulate_round_compute_times(key_n, h, cv, barrier_trials, (seed, 6, int(cv * 1000)))
    cc = simulate_barrier_coupled(key_n, h, cv, barrier_rounds, barrier_coupled_trials,
                                  (seed, 7, int(cv * 1000)))
    sweep.append(dict(step_cv=cv, extra_decoupled=barrier_extra_decoupled(wc)["extra"],
                      extra_coupled=cc["extra"]))
  out["barrier"] = dict(
      n=key_n, h=h, step_cv=step_cv, trials=barrier_trials, rounds=barrier_rounds,
      coupled_trials=barrier_coupled_trials,
      extra_decoupled=decoupled["extra"], extra_coupled=coupled["extra"],
      diloco_round=decoupled["diloco_round"], noloco_round_decoupled=decoupled["noloco_round"],
      noloco_round_coupled=coupled["noloco_round"], diloco_round_coupled=coupled["diloco_round"],
      extra_decoupled_by_n=barrier_extra_by_n(w, ns),
      sweep=sweep,
      step_cv_for_20pct_decoupled=step_cv_for_extra(sweep, "extra_decoupled", 0.2),
      step_cv_for_20pct_coupled=step_cv_for_extra(sweep, "extra_coupled", 0.2),
  )

  # α–β model.
  out["alpha_beta"] = dict(alpha_s=alpha, link_bps=list(link_bps), ns=list(ab_ns),
                           rows=alpha_beta_table(ab_ns, link_bps, ("float32", "bfloat16"), alpha))

  # Headline figures, flat, for quick reading.
  out["headline"] = dict(
      key_n=key_n,
      constant_speedup=out["constant"]["speedup_at_key_n"],
      lognormal_ratio=out["lognormal"]["ratio_at_key_n"],
      barrier_extra_decoupled=decoupled["extra"],
      barrier_extra_coupled=coupled["extra"],
      params_small=out["params"]["small"], params_medium=out["params"]["medium"],
      params_large=out["params"]["large"],
  )
  return out


# ----------------------------------------------------------------------------------------------------
# 9. The asynchronous schedule on one setting
# ----------------------------------------------------------------------------------------------------


def async_schedule(step_times: np.ndarray, inner_steps: int, *, window_s: float, max_wait_s: float,
                   exchange_s=0.0, until_s: float | None = None, seed: int = 0, odd: str = "triple",
                   overlap_steps: int = 0) -> dict:
  """The asynchronous schedule (docs/async.md) on per-process compute times, as `barrier_schedule` for the others.

  step_times [steps, P]: seconds of compute of each process's every step (straggler_step_times, or the
  log-normal draws a run slept); rounds of `inner_steps` steps. Nobody waits for anyone but its partner:
  law.simulate plays the pairing law (batches of ready processes, window_s, max_wait_s, groups drawn from
  (seed, batch)) and each exchange costs `exchange_s`. With `until_s` no process starts a round after it
  (so processes of different speeds cover the same wall time). Returns per process the idle fraction
  (everything but compute: waiting for a partner, exchanging, waiting out a skip), rounds, exchanges
  and skips, compute and end times, and steps/s of the job (Σ steps / the latest end). `exchange_s`: seconds
  per exchange, or a function of the group (per-node links: `per_node_exchange_s`); `overlap_steps` τ: the
  round runs beside the next round's first τ steps (law.simulate's overlap τ/H).
  """
  durations = per_barrier(np.asarray(step_times, np.float64), inner_steps).T  # [P, rounds]
  sim = law.simulate(durations, window_s=window_s, max_wait_s=max_wait_s, exchange_s=exchange_s, seed=seed,
                     until_s=until_s, odd=odd, overlap=overlap_steps / inner_steps)
  end = np.maximum(sim.end_s, 1e-12)
  return {"idle_fraction": [float(x) for x in (end - sim.busy_s) / end], "rounds": sim.rounds.tolist(),
          "exchanges": sim.exchanges.tolist(), "skips": sim.skips.tolist(), "busy_s": sim.busy_s.tolist(),
          "end_s": sim.end_s.tolist(), "steps_per_s": float(sim.rounds.sum() * inner_steps / end.max()),
          "wall_s_per_round": float(np.median(end / np.maximum(sim.rounds, 1)))}


# ----------------------------------------------------------------------------------------------------
# 10. Per-node links
# ----------------------------------------------------------------------------------------------------
# Each process q has a link of its own: it sends at up[q] and receives at down[q] bits per second
# (node_links.Link; the rates a run's self-test measured, TCP goodput). Links are independent, so a
# group's exchange costs what its members' links give, whatever the other groups do:
#  * a group exchange (NoLoCo, gossip; pairs or a triple): every member sends its message of S bytes to
#    each of the n − 1 others and receives theirs, all at once; member q's uplink carries (n − 1)·S and
#    its downlink (n − 1)·S, so the exchange ends when the busiest of them has: max over members of
#    (n − 1)·S·8 / min(up[q], down[q]).
#  * a ring all-reduce over the group in slot order (DiLoCo per round, DDP per step): 2(n − 1) steps in
#    sequence, each moving S/n from every member to the next at once, so each step lasts as long as the
#    slowest hop: 2(n − 1)/n · S·8 / min over hops (q → q+1) of min(up[q], down[q + 1]).
# No latency is added (no delay emulation on the links: experiments/lib/node_links.py); an exchange's
# software cost is the α of the caller.


def per_node_exchange_s(kind: str, group, message_bytes: float, up_bit_s, down_bit_s) -> float:
  """Seconds of one exchange of `kind` ("group" or "ring") among `group` (slots) on per-node links."""
  group = sorted(group)
  n = len(group)
  if n < 2:
    return 0.0
  if kind == "group":
    return max((n - 1) * message_bytes * 8 / min(up_bit_s[q], down_bit_s[q]) for q in group)
  if kind == "ring":
    hops = [min(up_bit_s[q], down_bit_s[group[(i + 1) % n]]) for i, q in enumerate(group)]
    return 2 * (n - 1) / n * message_bytes * 8 / min(hops)
  raise ValueError(f"kind={kind!r}: 'group' or 'ring'")
