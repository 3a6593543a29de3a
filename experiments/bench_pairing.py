"""What a fresh pairing costs: the compile per round, the stall at round boundaries, the inner steps slowed.

With outer.pairing=fresh on a mesh every round's grouping needs its own program (ppermute's routing is
static). For NoLoCo and gossip that program holds only the grouping's routes (outer/programs.py: the
message and the merge are compiled once), compiled on a background thread while the previous round's
inner steps run (noloco_jax/outer/programs.py). This runs the loop's round structure (H inner steps on
synthetic tokens, then the round) on N fake CPU devices, one replica each, and measures per round:

  round_s   wall time of the round: H inner steps plus the outer step, device work included;
  inner_s   the H inner steps, until their results are ready;
  stall_s   time the round boundary blocked waiting for its compiled programs (RoundPrograms' record),
            after the inner steps had finished; with --mode=fresh_inline (no compile ahead: each new
            grouping compiled when first called) it is the compile on the critical path instead;
  boundary_s  the whole host call that hands out the round's programs (drawing the grouping, the cache
            look-up, the wait if any, announcing the next round): the stall plus its bookkeeping.

and per mode, over the steady rounds (every round but the first: round 0's boundary also waits for the
inner step's own first compile), the stall/round fraction and compile_fraction = the seconds of every
compile of the run (the grouping's and the message's and merge's) / the seconds of the inner steps.
Modes:

  fresh         the default: a new grouping per round, its routes compiled one round ahead;
  fresh_inline  the same groupings compiled on first use (what `fresh` cost before compile-ahead);
  round_robin   one program for the whole run (lax.switch over N−1 matchings): the no-compile reference
                for round_s (a slower fresh round_s would be the background compile competing for CPU).

`--compile_cost` (on by default) also measures, on the fresh setup, what one compile costs: the
seconds to compile the program a new grouping needs (`routes_compile_s`) against the whole round in one
program (`whole_round_compile_s`, what every fresh round compiled before the round was split), and the
inner step's time while a compile of either runs without pause on the background thread, against no
compile (`slowdown_while_compiling`: the worst case, a compile for the whole of the steps).

    python experiments/bench_pairing.py --json                         # default outer config, tiny model
    python experiments/bench_pairing.py --modes=fresh,round_robin --config.outer.inner_steps=5 --json
    python experiments/bench_pairing.py --modes=fresh --rounds=20 --config.model.d_model=256 --json

The default config's outer settings are used as they are (N = 8, n = 2, H = 50, fresh); only the model
is shrunk (--preset, --config.model.FIELD=VALUE) so that it runs on CPU. Every fake device shares the same cores.
"""

from __future__ import annotations

import os
import threading
import time

from experiments.lib import harness

MODES = ("fresh", "fresh_inline", "round_robin")


def _setup(args, bench, pairing: str):
  import numpy as np  # pylint: disable=g-import-not-at-top

  from noloco_jax.parallel import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  cfg = bench.config()
  cfg.model.preset = args.preset
  cfg.outer.pairing = pairing
  bench.override(cfg)
  vocab = 257
  setup = build_lib.build(cfg, vocab_size=vocab)
  N = cfg.num_replicas
  rng = np.random.default_rng(0)
  batches = [sharding_lib.global_array(setup.mesh, rng.integers(0, vocab, size=(N, cfg.data.batch_size,
                                                                                cfg.data.seq_len + 1)).astype(np.int32), N)
             for _ in range(4)]
  return setup, setup.init_state(), batches


def run_mode(mode: str, args, bench) -> dict:
  import jax  # pylint: disable=g-import-not-at-top (after the fake-device flags are set)
  import numpy as np  # pylint: disable=g-import-not-at-top

  setup, state, batches = _setup(args, bench, "round_robin" if mode == "round_robin" else "fresh")
  H = setup.config.outer.inner_steps  # validated: H resolved for the kind
  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top
  programs = setup.rounds
  programs.start(state, compile_ahead=mode != "fresh_inline")
  rounds, inner, stalls, boundaries = [], [], [], []
  try:
    for round_ in range(args.rounds):
      start = time.perf_counter()
      for step in range(H):
        state, metrics = setup.inner_step(state, batches[step % len(batches)])
      # The round needs the inner steps' state: waiting here first makes the stall what the boundary
      # waits beyond the inner steps, not beyond their dispatch.
      jax.block_until_ready(metrics)
      inner.append(time.perf_counter() - start)
      waits_before = len(programs.stats.waits_s)
      t0 = time.perf_counter()
      compiled, route = programs.program(round_)
      round_fn = programs_lib.lockstep_round(compiled)
      boundaries.append(time.perf_counter() - t0)
      stalls.append(programs.stats.waits_s[waits_before])
      state, round_metrics = round_fn(state, route)
      jax.block_until_ready((state, round_metrics))
      rounds.append(time.perf_counter() - start)
  finally:
    programs.close()
  stats = programs.stats
  steady = slice(1, None)
  grouping = [s for s, key in zip(stats.compile_s, stats.keys) if not isinstance(key, str)]
  fixed = {key: round(s, 4) for s, key in zip(stats.compile_s, stats.keys) if isinstance(key, str)}
  return {
      "round_s": [round(x, 4) for x in rounds],
      "inner_s": [round(x, 4) for x in inner],
      "stall_s": [round(x, 4) for x in stalls],
      "boundary_s": [round(x, 5) for x in boundaries],
      "compile_s": [round(x, 4) for x in grouping],  # the programs of a grouping key (routes, or whole rounds)
      "fixed_compile_s": fixed,  # the programs every round runs (message, merge), compiled once
      "steady_mean_round_s": float(np.mean(rounds[steady])),
      "steady_mean_inner_s": float(np.mean(inner[steady])),
      "steady_mean_stall_s": float(np.mean(stalls[steady])),
      "steady_max_stall_s": float(np.max(stalls[steady])),
      "steady_stall_fraction": float(np.sum(stalls[steady]) / np.sum(rounds[steady])),
      "steady_boundary_fraction": float(np.sum(boundaries[steady]) / np.sum(rounds[steady])),
      "compile_fraction": float(sum(stats.compile_s) / np.sum(inner)),
      "first_round_stall_s": float(stalls[0]),
  }


def _steps_s(setup, state, batches, steps: int):
  """(state, seconds per inner step) over `steps` steps, waited for."""
  import jax  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  for step in range(steps):
    state, metrics = setup.inner_step(state, batches[step % len(batches)])
  jax.block_until_ready((state, metrics))
  return state, (time.perf_counter() - start) / steps


def compile_cost(args, bench) -> dict:
  """One compile of a new grouping's program against one of the whole round; the inner steps' time while
  either compiles without pause in the background, against none."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top
  setup, state, batches = _setup(args, bench, "fresh")
  rounds, mesh = setup.rounds, setup.mesh
  struct = programs_lib.abstract(state)

  def whole(r):  # the whole round of round r's grouping in one program: what a fresh round compiled before
    key, _ = rounds.plan(r)
    return programs_lib.make_round_fn(setup.method, mesh, key, setup.state_shardings).lower(
        struct, rounds.route_struct(key)).compile()

  if rounds.split:
    rounds.jitted("message", struct)  # the layout the routes are built for

  def routes(r):  # what a fresh round compiles now: its grouping's routes only (NoLoCo, gossip)
    key, _ = rounds.plan(r)
    return rounds._lower(key).compile()  # pylint: disable=protected-access

  def timed(fn, r):
    start = time.perf_counter()
    fn(r)
    return time.perf_counter() - start

  state, _ = _steps_s(setup, state, batches, 3)  # the inner step compiled and warm
  result = {"whole_round_compile_s": [round(timed(whole, r), 4) for r in range(1, 1 + args.compiles)]}
  if rounds.split:
    result["routes_compile_s"] = [round(timed(routes, r), 4) for r in range(1, 1 + args.compiles)]
    result["compile_ratio_routes_over_whole"] = float(np.median(result["routes_compile_s"]) /
                                                      np.median(result["whole_round_compile_s"]))
  step_s = {}
  state, step_s["idle"] = _steps_s(setup, state, batches, args.steps)
  for name, fn in (("whole_round", whole), ("routes", routes if rounds.split else None)):
    if fn is None:
      continue
    stop = threading.Event()

    def compile_forever(fn=fn, stop=stop):
      r = 1000  # groupings not compiled above: nothing is cached
      while not stop.is_set():
        fn(r)
        r += 1
    worker = threading.Thread(target=compile_forever, daemon=True)
    worker.start()
    time.sleep(0.2)  # the first compile under way
    state, step_s[f"while_compiling_{name}"] = _steps_s(setup, state, batches, args.steps)
    stop.set()
    worker.join()
  state, step_s["idle_after"] = _steps_s(setup, state, batches, args.steps)
  idle = (step_s["idle"] + step_s["idle_after"]) / 2
  result["inner_step_s"] = {k: round(v, 5) for k, v in step_s.items()}
  result["slowdown_while_compiling"] = {k.removeprefix("while_compiling_"): float(v / idle)
                                        for k, v in step_s.items() if k.startswith("while_")}
  return result


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=8, cpu_only=True)
  bench.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
  bench.add_argument("--rounds", type=int, default=12, help="outer rounds per mode")
  bench.add_argument("--preset", default="tiny", help="model preset")
  bench.add_argument("--compile_cost", type=int, default=1, help="1: also measure one compile and the slowdown")
  bench.add_argument("--compiles", type=int, default=3, help="compiles timed per program kind (--compile_cost)")
  bench.add_argument("--steps", type=int, default=20, help="inner steps timed per condition (--compile_cost)")
  args = bench.parse(argv)
  modes = args.modes.split(",") if args.modes else []
  for mode in modes:
    if mode not in MODES:
      harness.usage_error(f"--modes: {mode!r} is not one of {MODES}")
  from noloco_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  base = config_lib.validate(bench.override(bench.config()))  # n and H resolved for the kind
  result = {"replicas": base.num_replicas, "group_size": base.outer.rule.group_size,
            "inner_steps": base.outer.inner_steps, "preset": args.preset, "overrides": bench.overrides(),
            "rounds": args.rounds, "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "modes": {}}
  for mode in modes:
    result["modes"][mode] = run_mode(mode, args, bench)
    m = result["modes"][mode]
    bench.note(f"{mode:13s} round {m['steady_mean_round_s']:.3f} s  stall mean {m['steady_mean_stall_s'] * 1e3:.1f} ms "
               f"max {m['steady_max_stall_s'] * 1e3:.1f} ms  stall/round {100 * m['steady_stall_fraction']:.2f}%  "
               f"compile/inner {100 * m['compile_fraction']:.2f}%")
  if "fresh" in modes and "round_robin" in modes:
    result["round_time_ratio_fresh_over_round_robin"] = (result["modes"]["fresh"]["steady_mean_round_s"] /
                                                         result["modes"]["round_robin"]["steady_mean_round_s"])
    result["inner_time_ratio_fresh_over_round_robin"] = (result["modes"]["fresh"]["steady_mean_inner_s"] /
                                                         result["modes"]["round_robin"]["steady_mean_inner_s"])
    bench.note(f"fresh / round_robin: round time {result['round_time_ratio_fresh_over_round_robin']:.3f}, "
               f"inner steps {result['inner_time_ratio_fresh_over_round_robin']:.3f}")
  if args.compile_cost:
    result["compile_cost"] = cost = compile_cost(args, bench)
    bench.note(f"compile: whole round {cost['whole_round_compile_s']} s, routes {cost.get('routes_compile_s')} s; "
               f"inner step slowed while compiling: {cost['slowdown_while_compiling']}")
  return bench.finish(result)


if __name__ == "__main__":
  harness.run(main)
