"""Outer-step wall time and bytes per replica: NoLoCo against DiLoCo (and DDP's per-step all-reduce).

For each process count P in --processes (default 1, 2, 4), one job of N = --replicas replicas on N fake
CPU devices, P processes × N/P devices over loopback (P = 1: one process, no jax.distributed), measures:

  noloco round     the whole outer step of outer.kind=noloco (group mean by ppermute, n = group_size)
  noloco exchange  only its collective: the group mean of one model-sized float32 tree
  diloco round     the whole outer step of outer.kind=diloco (one all-reduce of the pseudo-gradient)
  all-reduce       only the collective: the mean over all replicas of one model-sized float32 tree.
                   This is also DDP's gradient averaging, paid once per *inner* step, not per round.

Time: median over --repeats calls of the slowest process's wall time; before each call all processes
meet at a barrier, so a call is timed from a common start. Bytes: operand bytes of the collectives in
each compiled program (noloco_jax/tools/hlo.py), i.e. what each replica puts into a collective; NoLoCo's
round uses one fixed pairing (outer.pairing=fixed: a fresh round is one such program; round_robin's
lax.switch runs one such branch).

    python experiments/bench_outer.py --json                                  # tiny preset, P = 1, 2, 4
    python experiments/bench_outer.py --preset=small --config.model.num_layers=2 --processes=1,2 --json

On a machine with fewer cores than devices, every "device" shares the same cores, so these times
measure compute and memory traffic under contention as much as communication (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from experiments.lib import harness

ROOT = harness.REPO
RESULT_TAG = "BENCH_OUTER_RESULT "


# ---------------------------------------------------------------------------------------------------
# Worker: one process of the job.
# ---------------------------------------------------------------------------------------------------


def _worker(args, cfg) -> None:
  from noloco_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
  from noloco_jax.runtime import options as options_lib  # pylint: disable=g-import-not-at-top
  multi = distributed.initialize(options_lib.resolve_options())
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib
  from noloco_jax.parallel import mesh as mesh_lib
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import base as outer_base  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import methods as outer_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel.mesh import REPLICA  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import exchange  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top

  def timed(fn, carry, *rest):
    """Median over repeats of the slowest process's time for `carry = fn(carry, *rest)`."""
    for _ in range(args.warmup):
      carry = jax.block_until_ready(fn(carry, *rest))
    times = []
    for i in range(args.repeats):
      if multi:  # a common start: otherwise an early process would time its wait for the others
        multihost_utils.sync_global_devices(f"bench_outer_{i}")
      start = time.perf_counter()
      carry = jax.block_until_ready(fn(carry, *rest))
      times.append(time.perf_counter() - start)
    per_process = np.asarray(multihost_utils.process_allgather(np.asarray(times))) if multi else np.asarray([times])
    slowest = per_process.reshape(-1, args.repeats).max(axis=0)
    return carry, {"median_ms": 1e3 * float(np.median(slowest)), "p10_ms": 1e3 * float(np.percentile(slowest, 10)),
                   "p90_ms": 1e3 * float(np.percentile(slowest, 90))}

  results = {}
  n = cfg.num_replicas
  for kind in ("noloco", "diloco"):
    cfg.outer.kind = kind
    setup = build_lib.build(cfg, vocab_size=257)
    state = setup.init_state()
    compiled = setup.rounds.compile(state, 0)  # the round's programs as the training loop runs them
    index = jnp.int32(setup.rounds.plan(0)[1])
    one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
    # The round returns (state, metrics); time state -> state, the way the training loop chains rounds.
    state, timing = timed(lambda s, i: programs_lib.lockstep_round(compiled)(s, i)[0], state, index)
    text = "\n".join(c.as_text() for c in compiled.values())
    results[f"{kind}_round"] = {**timing, "collective_bytes": hlo_lib.all_collective_bytes(text),
                                "counted_bytes": setup.method.traffic(one_replica, setup.config.num_replicas)[0].operand}
    del state

  mesh, num_devices = setup.mesh, setup.mesh.shape[REPLICA]
  num_params = setup.model.num_params()
  params = jax.jit(lambda: jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), setup.init_state().params),
                   out_shardings=mesh_lib.replica_sharding(mesh))()
  groups = outer_lib.schedule(cfg.outer, seed=cfg.seed, num_replicas=cfg.num_replicas).groups(0)
  dtype = outer_base.MESSAGE_DTYPES[cfg.outer.codec.message_dtype]
  ddp_cfg = ml_collections.ConfigDict(cfg.outer.to_dict())
  ddp_cfg.kind = "ddp"
  collectives = {
      # NoLoCo's only collective: the group mean of c (n−1 ppermutes of one model-sized message).
      "noloco_exchange": lambda t: exchange.plain_group_mean(t, (groups,), 0, num_devices, dtype),
      # DiLoCo's (and DDP's) only collective: the mean over all replicas, one all-reduce.
      "allreduce": outer_lib.make(ddp_cfg).reduce_grads,
  }
  for name, fn in collectives.items():
    jitted = jax.jit(mesh_lib.replica_map(fn, mesh, in_specs=jax.P(REPLICA), out_specs=jax.P(REPLICA)))
    compiled = jitted.lower(params).compile()
    params, timing = timed(compiled, params)
    results[name] = {**timing, "collective_bytes": hlo_lib.all_collective_bytes(compiled.as_text())}

  memory = _memory(args, cfg, timed) if not multi else None
  if jax.process_index() == 0:
    print(RESULT_TAG + json.dumps({
        "processes": jax.process_count(), "devices": jax.device_count(), "replicas": n,
        "params_per_replica": num_params, "model_bytes_f32": 4 * num_params, "results": results,
        "memory": memory}), flush=True)


# ---------------------------------------------------------------------------------------------------
# Memory traffic of a round: XLA's bytes against the NumPy-copy floor (one process).
# ---------------------------------------------------------------------------------------------------

# The rounds measured: (name, outer config fields). `whole` is the lock-step round in one program (what
# the loop ran before it ran NoLoCo's round in parts); `overlapped` streaming overlap's message,
# exchange and delayed merge; `int8` a compressed message with error feedback.
MEMORY_ROUNDS = (("noloco", {}), ("noloco_whole", {}), ("noloco_int8", {"compression": "int8"}),
                 ("noloco_overlapped", {"overlap_steps": 1}), ("gossip", {"kind": "gossip"}),
                 ("diloco", {"kind": "diloco"}))


def _numpy_copy_s(num_bytes: int, repeats: int) -> float:
  """Median seconds NumPy takes to touch `num_bytes`: one copy that reads half of them and writes the other
  half (np.copyto, one thread): the floor for a program that only streams that much memory."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  src = np.ones(max(num_bytes // 8, 1), np.float32)
  dst = np.empty_like(src)
  times = []
  for _ in range(repeats + 1):
    start = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - start)
  return float(np.median(times[1:]))


def _memory(args, cfg, timed) -> dict:
  """Per round: the bytes every program of the round reads and writes on one device (XLA's cost analysis,
  summed over the round's programs) in model copies (the parameter bytes of one device's replicas), its
  time, and that time over the NumPy-copy floor of the same bytes on all devices."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import base as outer_base  # pylint: disable=g-import-not-at-top
  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel.mesh import REPLICA  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.training import build as build_lib  # pylint: disable=g-import-not-at-top
  out = {}
  for name, fields in MEMORY_ROUNDS:
    variant = ml_collections.ConfigDict(cfg.to_dict())
    variant.outer.kind = "noloco"
    for field, value in fields.items():
      variant.outer[field] = value
    setup = build_lib.build(variant, vocab_size=257)
    state = setup.init_state()
    devices = setup.mesh.devices.size
    copy = outer_base.tree_bytes(state.params) // devices  # one model copy: the params of one device's replicas
    if name == "noloco_overlapped":
      programs = programs_lib.RoundPrograms(setup.method, setup.mesh, setup.schedule, setup.state_shardings,
                                            where="exchange", mix=variant.outer.overlap.mix)
      _, route = programs.plan(0)
      compiled = programs.compile(state, 0)

      def run(s, r, c=compiled):
        s, sent, _ = c["message"](s)
        mean = c["exchange"](*sent, r)
        return c["merge"](s.replace(outer={**s.outer, outer_base.INFLIGHT: mean}))
    elif name == "noloco_whole":
      key, route = setup.rounds.plan(0)
      compiled = {"round": programs_lib.make_round_fn(setup.method, setup.mesh, key, setup.state_shardings).lower(
          programs_lib.abstract(state), setup.rounds.route_struct(key)).compile()}
      run = lambda s, r, c=compiled: c["round"](s, r)[0]
    else:
      compiled, (_, route) = setup.rounds.compile(state, 0), setup.rounds.plan(0)
      run = lambda s, r, fn=programs_lib.lockstep_round(compiled): fn(s, r)[0]
    per_program = {k: hlo_lib.bytes_accessed(c) / copy for k, c in compiled.items()}
    total = sum(per_program.values())
    # Parameters a program copies (buffers XLA could not update in place): each counts twice in `total`.
    copied = sum(hlo_lib.parameter_copies(c.as_text()) for c in compiled.values()) / copy
    state, timing = timed(run, state, jax.numpy.int32(route) if np.ndim(route) == 0 else jax.numpy.asarray(route))
    floor_s = _numpy_copy_s(int(total * copy * devices), args.repeats)
    out[name] = {"model_copies": total, "per_program": per_program, "parameter_copies": copied,
                 "round_ms": timing["median_ms"],
                 "numpy_floor_ms": 1e3 * floor_s, "round_over_floor": timing["median_ms"] / (1e3 * floor_s),
                 "copy_bytes_per_device": copy, "devices": devices, "replicas_per_device":
                 setup.config.num_replicas // setup.mesh.shape[REPLICA]}
    del state
  return out


# ---------------------------------------------------------------------------------------------------
# Driver: one job per process count, then the table.
# ---------------------------------------------------------------------------------------------------


def _run_job(args, argv, num_processes: int) -> dict:
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  if args.replicas % num_processes:
    raise SystemExit(f"--replicas={args.replicas} is not a multiple of {num_processes} processes.")
  worker_argv = [a for a in argv if not a.startswith(("--processes", "--json"))] + ["--worker"]
  with tempfile.TemporaryDirectory() as logs:
    job = launch_local.Job(num_processes, args.replicas // num_processes, worker_argv, script=os.path.abspath(__file__),
                           log_dir=logs, cwd=ROOT)
    codes = job.wait(timeout_s=args.timeout_s, grace_s=30)
    text = open(job.log_paths[0]).read()
    if codes != [0] * num_processes:
      tails = "\n".join(open(p).read()[-3000:] for p in job.log_paths)
      raise SystemExit(f"bench_outer: the {num_processes}-process job failed with {codes}:\n{tails}")
  line = next(l for l in text.splitlines() if l.startswith(RESULT_TAG))
  return json.loads(line[len(RESULT_TAG):])


def _table(runs: list[dict]) -> tuple[str, dict]:
  rows = ["| processes × devices | noloco round (ms) | diloco round (ms) | round ratio N/D | noloco exchange (ms) "
          "| all-reduce = ddp step (ms) | exchange ratio N/D | collective operand bytes/replica: noloco | diloco | ddp per step |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  ratios = {}
  for run in runs:
    r = run["results"]
    nb = r["noloco_round"]["collective_bytes"].get("collective-permute", 0)
    db = r["diloco_round"]["collective_bytes"].get("all-reduce", 0)
    ab = r["allreduce"]["collective_bytes"].get("all-reduce", 0)
    key = f"{run['processes']}x{run['devices'] // run['processes']}"
    ratios[key] = {
        "round_time": r["noloco_round"]["median_ms"] / r["diloco_round"]["median_ms"],
        "collective_time": r["noloco_exchange"]["median_ms"] / r["allreduce"]["median_ms"],
        "bytes": nb / db if db else float("nan"),
        # A ring all-reduce sends ≈ 2·(D−1)/D × its operand over each device's link; a ppermute, the operand.
        "bytes_on_wire_ring": nb / (2 * (run["devices"] - 1) / run["devices"] * db) if db else float("nan"),
    }
    rows.append(f"| {run['processes']} × {run['devices'] // run['processes']} | {r['noloco_round']['median_ms']:.2f} "
                f"| {r['diloco_round']['median_ms']:.2f} | {ratios[key]['round_time']:.2f} "
                f"| {r['noloco_exchange']['median_ms']:.2f} | {r['allreduce']['median_ms']:.2f} "
                f"| {ratios[key]['collective_time']:.2f} | {nb:,} | {db:,} | {ab:,} |")
  return "\n".join(rows), ratios


def main(argv=None) -> dict | None:
  argv = list(sys.argv[1:] if argv is None else argv)
  bench = harness.Bench(__doc__, config=True)
  bench.add_argument("--processes", default="1,2,4", help="comma-separated process counts")
  bench.add_argument("--replicas", type=int, default=8, help="N replicas = N fake CPU devices in all")
  bench.add_argument("--preset", default="tiny", help="model preset (tiny | small | medium | large)")
  bench.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
  bench.add_argument("--warmup", type=int, default=3, help="untimed calls first")
  bench.add_argument("--timeout_s", type=float, default=900, help="per job")
  bench.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = bench.parse(argv)
  cfg = bench.config()
  cfg.num_replicas = args.replicas
  cfg.model.preset = args.preset
  cfg.outer.pairing = "fixed"
  bench.override(cfg)
  if args.worker:
    _worker(args, cfg)
    return None
  runs = []
  for p in [int(x) for x in args.processes.split(",") if x]:
    start = time.time()
    runs.append(_run_job(args, argv, p))
    runs[-1]["job_wall_s"] = round(time.time() - start, 1)
    print(f"bench_outer: {p} process(es) done in {runs[-1]['job_wall_s']} s", file=sys.stderr, flush=True)
  table, ratios = _table(runs)
  first = runs[0]
  header = (f"model: preset {args.preset} {bench.overrides() or ''}, {first['params_per_replica']:,} parameters per "
            f"replica ({first['model_bytes_f32']:,} bytes in float32); {args.replicas} replicas; median of "
            f"{args.repeats} calls, slowest process.")
  memory = next((run["memory"] for run in runs if run.get("memory")), None)
  result = {"preset": args.preset, "overrides": bench.overrides(), "replicas": args.replicas,
            "repeats": args.repeats, "runs": runs, "ratios_noloco_over_diloco": ratios}
  if memory:
    table += "\n\n" + _memory_table(memory)
    # The figures the next change is measured by (issue 26 item 3): model copies through memory per device
    # per round, and the round's time over the NumPy-copy floor of those bytes.
    result["round_model_copies"] = {name: m["model_copies"] for name, m in memory.items()}
    result["round_over_numpy_floor"] = {name: m["round_over_floor"] for name, m in memory.items()}
  return bench.finish(result, text=lambda _: header + "\n" + table)


def _memory_table(memory: dict) -> str:
  rows = ["one process: bytes each round reads and writes per device (XLA cost analysis, summed over the round's "
          "programs) in model copies, and its time over the NumPy-copy floor of the same bytes on all devices",
          "| round | model copies | per program | parameters copied | round (ms) | NumPy floor (ms) | round / floor |",
          "|---|---|---|---|---|---|---|"]
  for name, m in memory.items():
    parts = ", ".join(f"{k} {v:.2f}" for k, v in m["per_program"].items())
    rows.append(f"| {name} | {m['model_copies']:.2f} | {parts} | {m['parameter_copies']:.2f} | {m['round_ms']:.2f} "
                f"| {m['numpy_floor_ms']:.2f} | {m['round_over_floor']:.2f} |")
  return "\n".join(rows)


if __name__ == "__main__":
  harness.run(main)
