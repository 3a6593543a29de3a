"""A toy job on the asynchronous schedule: every piece of noloco_jax/asynchronous/ on real processes, no model.

Each process holds one "replica": a vector θ trained by SGD with momentum (optax) on its own
quadratic loss ½‖θ − target_p‖² (a different target per process, so only the exchanges pull the
replicas together), H inner steps per round, then NoLoCo's round (its message and merge,
noloco_jax/outer/methods/noloco.py) with the staleness-weighted mean (outer/async_rules.py) of whatever
group the matchmaker finds. It is what the multi-process tests
launch, and a way to watch the schedule work:

    python -m noloco_jax.runtime.launch_local --num_processes=4 --devices_per_process=1 \\
        --module=experiments.async_demo -- --rounds=30 --log_dir=runs/async_demo

NOLOCO_FAULTS (noloco_jax/runtime/faults.py) applies after every inner step (e.g. `kill:process=2,step=40`).
`--join` makes a (re)started process take its state from a live peer before training (churn.py).
Every round goes to LOG_DIR/rounds_<slot>.jsonl with digests of the whole state before its message and
after its update (a failed or skipped round must leave it bit for bit: tests/test_async_exchange_faults.py).
At the end each process writes LOG_DIR/result_<slot>.json; process 0, which hosts the coordination
service unless `--standalone_service`, waits (up to --linger_s) for the others to finish first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import default
from experiments.lib import harness
from noloco_jax.asynchronous import control, session as session_lib
from noloco_jax.inner.state import TrainState
from noloco_jax.io.checkpoint.logs import JsonlLog
from noloco_jax.outer import async_rules, methods
from noloco_jax.runtime import faults


def _digest(tree) -> str:
  return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(tree))).hexdigest()[:16]


def main(argv=None) -> None:
  bench = harness.Bench(__doc__)
  bench.add_argument("--rounds", type=int, default=20, help="rounds to run (at least)")
  bench.add_argument("--run_s", type=float, default=0.0, help="keep starting rounds until this many seconds")
  bench.add_argument("--until_file", default=None,
                     help="with --run_s: stop starting rounds sooner, once this file exists (a test's signal that "
                           "what it waits for has happened, so a quiet machine does not sit out a loaded one's time)")
  bench.add_argument("--inner_steps", type=int, default=5)
  bench.add_argument("--step_s", type=float, default=0.02, help="seconds of simulated compute per inner step")
  bench.add_argument("--dim", type=int, default=1024, help="floats per message")
  bench.add_argument("--log_dir", required=True)
  bench.add_argument("--seed", type=int, default=0)
  bench.add_argument("--window_s", type=float, default=0.05)
  bench.add_argument("--max_wait_s", type=float, default=3.0)
  bench.add_argument("--exchange_timeout_s", type=float, default=20.0)
  bench.add_argument("--lease_s", type=float, default=6.0)
  bench.add_argument("--partner_silence_s", type=float, default=3.0,
                     help="give up on a partner whose heartbeat is silent this long (stopped)")
  bench.add_argument("--decay", type=float, default=float(np.log(2.0)), help="staleness decay per round of lag")
  bench.add_argument("--odd", default="triple")
  bench.add_argument("--join", action="store_true", help="take the state from a live peer first")
  bench.add_argument("--standalone_service", action="store_true")
  bench.add_argument("--linger_s", type=float, default=120.0)
  bench.add_argument("--heartbeat_timeout_s", type=int, default=30,
                     help="the coordination service holds a process silent this long dead (a stop past it ends it)")
  opts = bench.parse(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

  slot = int(os.environ["NOLOCO_PROCESS_ID"])
  # The control plane only (as the trainer's asynchronous schedule): this process's JAX sees its own devices.
  connection = control.connect(os.environ["NOLOCO_COORDINATOR_ADDRESS"], int(os.environ["NOLOCO_NUM_PROCESSES"]),
                               slot, heartbeat_timeout_s=opts.heartbeat_timeout_s,
                               standalone_service=opts.standalone_service)
  options = session_lib.Options(seed=opts.seed, window_s=opts.window_s, max_wait_s=opts.max_wait_s,
                                exchange_timeout_s=opts.exchange_timeout_s, lease_s=opts.lease_s,
                                beat_s=min(0.5, opts.lease_s / 4), odd=opts.odd, join_timeout_s=30.0,
                                partner_silence_s=opts.partner_silence_s)
  os.makedirs(opts.log_dir, exist_ok=True)
  logs = [JsonlLog(os.path.join(opts.log_dir, f"{name}_{slot}.jsonl")) for name in ("pairings", "membership", "rounds")]
  session = session_lib.Session(connection.kv, slot, connection.incarnation, options, pairings=logs[0], events=logs[1])
  injector = faults.from_env(slot)
  lr = 0.1
  outer = default.get_config().outer  # NoLoCo, the rule the trainer runs (its α, β, γ set here)
  outer.rule.update(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9)
  parts = methods.make(outer).parts
  message, merge = jax.jit(parts.message), jax.jit(lambda state, mean: parts.merge(state, mean, None))
  mean_of = jax.jit(lambda own, received, weights: parts.mean(own, received, weights))

  target = jnp.asarray(np.random.default_rng(1000 + slot).normal(size=(1, opts.dim)), jnp.float32)
  tx = optax.sgd(lr, momentum=0.5)
  theta = jnp.zeros((1, opts.dim), jnp.float32)  # one replica: a stack of one, as the trainer's
  state = TrainState(step=jnp.zeros((1,), jnp.int32), params=theta, opt_state=tx.init(theta),
                     outer=jax.vmap(methods.make(outer).init)(theta))
  step = 0
  result = {"slot": slot, "incarnation": str(session.incarnation)}
  if opts.join:
    (peer_phi, peer_inner), donor, progress = session.join((state.outer["slow"], state.opt_state))
    one = jax.tree.map(lambda x: np.asarray(x)[0], (state.params, {**state.outer, "slow": peer_phi}))
    params, new_outer = methods.make(outer).new_replica(*one)  # checkpoint.elastic=grow's rule: θ = φ_peer, δ = 0
    state = state.replace(params=jnp.asarray(params)[None], outer=jax.tree.map(lambda x: jnp.asarray(x)[None], new_outer),
                          opt_state=peer_inner)
    step = progress
    result.update(joined_from=donor, joined_progress=progress, joined_phi=_digest(state.outer["slow"]),
                  joined_inner=_digest(state.opt_state),
                  joined_delta_zero=bool(jnp.all(state.outer["momentum"] == 0)))

  @jax.jit
  def inner_step(state):
    grads = state.params - target  # ∇ ½‖θ − target‖²
    updates, inner = tx.update(grads, state.opt_state, state.params)
    return state.replace(params=optax.apply_updates(state.params, updates), opt_state=inner)

  served = []
  start = time.monotonic()
  rounds = 0
  signalled = lambda: opts.until_file is not None and os.path.exists(opts.until_file)
  while rounds < opts.rounds or (time.monotonic() - start < opts.run_s and not signalled()):
    for _ in range(opts.inner_steps):
      state = inner_step(state)
      step += 1
      session.step = step
      time.sleep(opts.step_s)
      if injector is not None:  # None without NOLOCO_FAULTS (a restarted process runs without it)
        injector.after_step(step, state.params)
    before = _digest(state)
    state, own, payload, _ = message(state)
    outcome = session.round(payload, progress=step)
    if outcome.exchanged:  # the group's messages, own first: the weighted mean, then NoLoCo's merge
      weights = async_rules.staleness_weights(outcome.progress, inner_steps=opts.inner_steps, decay=opts.decay)
      weights = None if async_rules.equal(weights) else weights  # equal: the lock-step mean's arithmetic
      state = merge(state, mean_of(own, tuple(outcome.messages[1:]), weights))
    logs[2].append({"step": step, "time": time.time(), "status": outcome.status, "batch": outcome.batch,
                    "group": list(outcome.group), "before": before, "after": _digest(state)})
    phi = state.outer["slow"]
    if session.serve_joins(lambda: (state.outer["slow"], state.opt_state), progress=step):
      served.append({"phi": _digest(phi), "inner": _digest(state.opt_state), "progress": step})
    rounds += 1

  spread = float(jnp.linalg.norm(phi - target))
  result.update(rounds=rounds, steps=step, served=served, distance_to_own_target=spread, **session.summary())
  with open(os.path.join(opts.log_dir, f"result_{slot}.json"), "w") as f:
    json.dump(result, f)
  logging.info("Slot %d done: %d rounds, %s.", slot, rounds, session.matchmaker.stats.as_dict())
  linger = opts.linger_s if (slot == 0 and not opts.standalone_service) else 0.0
  session.close(linger_s=linger)
  for log in logs:
    log.close()
  bench.finish(result)  # also as the last line of this process's output (its log under launch_local)
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  # A normal exit runs JAX's shutdown, which waited 8–10 s for the other processes (docs/async.md §8);
  # this process has already marked its lease "left", so it leaves at once.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  harness.run(main)
