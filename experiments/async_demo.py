"""A toy job on the asynchronous schedule: every piece of noloco_jax/asynchronous/ on real processes, no model.

Each process holds one "replica": a vector θ trained by SGD with momentum (optax) on its own
quadratic loss ½‖θ − target_p‖² (a different target per process, so only the exchanges pull the
replicas together), H inner steps per round, then a staleness-weighted NoLoCo round
(outer/async_rules.py) with whatever group the matchmaker finds. It is what the multi-process tests
launch, and a way to watch the schedule work:

    python -m noloco_jax.runtime.launch_local --num_processes=4 --devices_per_process=1 \\
        --module=experiments.async_demo -- --rounds=30 --log_dir=runs/async_demo

NOLOCO_FAULTS (noloco_jax/runtime/faults.py) applies after every inner step (e.g. `kill:process=2,step=40`).
`--join` makes a (re)started process take its state from a live peer before training (churn.py).
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

from experiments.lib import harness
from noloco_jax.asynchronous import churn, control, session as session_lib
from noloco_jax.outer import async_rules, rules
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
  bench.add_argument("--decay", type=float, default=float(np.log(2.0)), help="staleness decay per round of lag")
  bench.add_argument("--odd", default="triple")
  bench.add_argument("--join", action="store_true", help="take the state from a live peer first")
  bench.add_argument("--standalone_service", action="store_true")
  bench.add_argument("--linger_s", type=float, default=120.0)
  opts = bench.parse(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

  slot = int(os.environ["NOLOCO_PROCESS_ID"])
  # The control plane only (as the trainer's asynchronous schedule): this process's JAX sees its own devices.
  connection = control.connect(os.environ["NOLOCO_COORDINATOR_ADDRESS"], int(os.environ["NOLOCO_NUM_PROCESSES"]),
                               slot, heartbeat_timeout_s=30, standalone_service=opts.standalone_service)
  options = session_lib.Options(seed=opts.seed, window_s=opts.window_s, max_wait_s=opts.max_wait_s,
                                exchange_timeout_s=opts.exchange_timeout_s, lease_s=opts.lease_s,
                                beat_s=min(0.5, opts.lease_s / 4), odd=opts.odd, join_timeout_s=30.0)
  session = session_lib.Session(connection.kv, slot, connection.incarnation, options, log_dir=opts.log_dir)
  injector = faults.from_env(slot)
  alpha, beta, gamma, lr = 0.5, 0.7, 0.9, 0.1

  target = jnp.asarray(np.random.default_rng(1000 + slot).normal(size=opts.dim), jnp.float32)
  tx = optax.sgd(lr, momentum=0.5)
  theta = jnp.zeros(opts.dim, jnp.float32)
  phi, delta, inner = theta, jnp.zeros_like(theta), tx.init(theta)
  step = 0
  result = {"slot": slot, "incarnation": str(session.incarnation)}
  if opts.join:
    (peer_phi, peer_inner), donor, progress = session.join((phi, inner))
    theta, phi, delta, inner = churn.grow_from_peer(peer_phi, peer_inner, delta)
    step = progress
    result.update(joined_from=donor, joined_progress=progress, joined_phi=_digest(phi), joined_inner=_digest(inner),
                  joined_delta_zero=bool(jnp.all(delta == 0)))

  @jax.jit
  def inner_step(theta, inner):
    grads = theta - target  # ∇ ½‖θ − target‖²
    updates, inner = tx.update(grads, inner, theta)
    return optax.apply_updates(theta, updates), inner

  served = []
  start = time.monotonic()
  rounds = 0
  signalled = lambda: opts.until_file is not None and os.path.exists(opts.until_file)
  while rounds < opts.rounds or (time.monotonic() - start < opts.run_s and not signalled()):
    for _ in range(opts.inner_steps):
      theta, inner = inner_step(theta, inner)
      step += 1
      time.sleep(opts.step_s)
      if injector is not None:  # None without NOLOCO_FAULTS (a restarted process runs without it)
        injector.after_step(step, theta)
    message = rules.noloco_message(theta, phi, beta=beta, gamma=gamma)
    outcome = session.round(message, progress=step)
    if outcome.exchanged:
      theta, phi, delta = async_rules.async_noloco_update(phi, delta, outcome.messages, outcome.progress, alpha=alpha,
                                                          gamma=gamma, inner_steps=opts.inner_steps, decay=opts.decay)
    if session.serve_joins(lambda: (phi, inner), progress=step):
      served.append({"phi": _digest(phi), "inner": _digest(inner), "progress": step})
    rounds += 1

  spread = float(jnp.linalg.norm(phi - target))
  result.update(rounds=rounds, steps=step, served=served, distance_to_own_target=spread, **session.summary())
  with open(os.path.join(opts.log_dir, f"result_{slot}.json"), "w") as f:
    json.dump(result, f)
  logging.info("Slot %d done: %d rounds, %s.", slot, rounds, session.matchmaker.stats.as_dict())
  linger = opts.linger_s if (slot == 0 and not opts.standalone_service) else 0.0
  session.close(linger_s=linger)
  bench.finish(result)  # also as the last line of this process's output (its log under launch_local)
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  # A normal exit runs JAX's shutdown, which waited 8–10 s for the other processes (docs/async.md §8);
  # this process has already marked its lease "left", so it leaves at once.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  harness.run(main)
