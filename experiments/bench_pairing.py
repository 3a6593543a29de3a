"""The stall at round boundaries: how long a round waits for its outer program, per pairing mode.

With outer.pairing=fresh on a mesh every round's grouping is its own program. The loop compiles round
t+1's program on a background thread while round t+1's inner steps run (noloco_jax/outer/ahead.py), so
ideally nothing waits. This runs the loop's round structure (H inner steps on synthetic tokens, then
the outer step) on N fake CPU devices, one replica each, and measures per round:

  round_s   wall time of the round: H inner steps plus the outer step, device work included;
  stall_s   time the round boundary blocked waiting for its compiled program (RoundPrograms' record);
            with --mode=fresh_inline (no compile ahead: each new grouping compiled when first called)
            it is the compile on the critical path instead;
  boundary_s  the whole host call that hands out the round's program (drawing the grouping, the cache
            look-up, the wait if any, announcing the next round): the stall plus its bookkeeping.

and prints one JSON object (--json) with, per mode, stall/round fractions over the steady rounds (every
round but the first: round 0's boundary also waits for the inner step's own first compile). Modes:

  fresh         the default: a new grouping per round, compiled one round ahead;
  fresh_inline  the same groupings compiled on first use (what `fresh` cost before compile-ahead);
  round_robin   one program for the whole run (lax.switch over N−1 matchings): the no-compile reference
                for round_s (a slower fresh round_s would be the background compile competing for CPU).

    python experiments/bench_pairing.py --json                         # default outer config, tiny model
    python experiments/bench_pairing.py --modes=fresh --rounds=20 --config.model.d_model=256 --json

The default config's outer settings are used as they are (N = 8, n = 2, H = 50, fresh); only the model
is shrunk (--preset, --config.model.FIELD=VALUE) so that it runs on CPU. Every fake device shares the same cores.
"""

from __future__ import annotations

import os
import time

from experiments.lib import harness

MODES = ("fresh", "fresh_inline", "round_robin")


def run_mode(mode: str, args, bench) -> dict:
  import jax  # pylint: disable=g-import-not-at-top (after the fake-device flags are set)
  import numpy as np  # pylint: disable=g-import-not-at-top

  from noloco_jax.parallel import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top

  cfg = bench.config()
  cfg.model.preset = args.preset
  cfg.outer.pairing = "round_robin" if mode == "round_robin" else "fresh"
  bench.override(cfg)
  vocab = 257
  setup = build_lib.build(cfg, vocab_size=vocab)
  N, H = cfg.num_replicas, setup.config.outer.inner_steps  # validated: H resolved for the kind
  state = setup.init_state()
  rng = np.random.default_rng(0)
  batches = [sharding_lib.global_array(setup.mesh, rng.integers(0, vocab, size=(N, cfg.data.batch_size,
                                                                                cfg.data.seq_len + 1)).astype(np.int32), N)
             for _ in range(4)]
  programs = setup.rounds.ahead(state) if mode != "fresh_inline" else None
  if programs is not None:
    programs.prefetch(0)
  rounds, stalls, boundaries = [], [], []
  try:
    for round_ in range(args.rounds):
      start = time.perf_counter()
      for step in range(H):
        state, metrics = setup.inner_step(state, batches[step % len(batches)])
      if programs is not None:
        waits_before = len(programs.compiler.stats.waits_s)
        t0 = time.perf_counter()
        round_fn, route = programs.program(round_)
        boundaries.append(time.perf_counter() - t0)
        stall = programs.compiler.stats.waits_s[waits_before]
      else:  # compiled when first called, on the critical path (after the inner steps have finished)
        jax.block_until_ready(metrics)
        t0 = time.perf_counter()
        jitted, route = setup.outer_round(round_)
        round_fn = jitted.lower(state, route).compile()
        stall = time.perf_counter() - t0
        boundaries.append(stall)
      state, round_metrics = round_fn(state, route)
      jax.block_until_ready((state, round_metrics))
      rounds.append(time.perf_counter() - start)
      stalls.append(stall)
  finally:
    if programs is not None:
      programs.close()
  steady = slice(1, None)
  compile_s = programs.compiler.stats.compile_s if programs is not None else []
  return {
      "round_s": [round(x, 4) for x in rounds],
      "stall_s": [round(x, 4) for x in stalls],
      "boundary_s": [round(x, 5) for x in boundaries],
      "compile_s": [round(x, 4) for x in compile_s],
      "steady_mean_round_s": float(np.mean(rounds[steady])),
      "steady_mean_stall_s": float(np.mean(stalls[steady])),
      "steady_max_stall_s": float(np.max(stalls[steady])),
      "steady_stall_fraction": float(np.sum(stalls[steady]) / np.sum(rounds[steady])),
      "steady_boundary_fraction": float(np.sum(boundaries[steady]) / np.sum(rounds[steady])),
      "first_round_stall_s": float(stalls[0]),
  }


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=8, cpu_only=True)
  bench.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
  bench.add_argument("--rounds", type=int, default=12, help="outer rounds per mode")
  bench.add_argument("--preset", default="tiny", help="model preset")
  args = bench.parse(argv)
  modes = args.modes.split(",")
  for mode in modes:
    if mode not in MODES:
      harness.usage_error(f"--modes: {mode!r} is not one of {MODES}")
  from noloco_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  base = config_lib.validate(bench.override(bench.config()))  # n and H resolved for the kind
  result = {"replicas": base.num_replicas, "group_size": base.outer.group_size,
            "inner_steps": base.outer.inner_steps, "preset": args.preset, "overrides": bench.overrides(),
            "rounds": args.rounds, "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "modes": {}}
  for mode in modes:
    result["modes"][mode] = run_mode(mode, args, bench)
    m = result["modes"][mode]
    bench.note(f"{mode:13s} round {m['steady_mean_round_s']:.3f} s  stall mean {m['steady_mean_stall_s'] * 1e3:.1f} ms "
               f"max {m['steady_max_stall_s'] * 1e3:.1f} ms  stall/round {100 * m['steady_stall_fraction']:.2f}%  "
               f"boundary/round {100 * m['steady_boundary_fraction']:.3f}%")
  return bench.finish(result)


if __name__ == "__main__":
  harness.run(main)
