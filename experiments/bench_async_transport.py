"""The data plane of the asynchronous schedule, measured before choosing: three ways to swap two messages.

Runs a job of three processes over loopback (one CPU device each) and measures, side by side in that
one job, for each message size (float32, MB each way):

  ppermute   a jitted `jax.shard_map` + `lax.ppermute` program over the pair's two-process sub-mesh
             (one program per pair): compile time, first call (gloo rendezvous of the pair), then the
             steady swap; a second pair's first call; a partner that calls late (how long the caller
             waits); a partner that skipped one exchange (which message each later call receives); a
             partner that dies during the call (how the caller learns it, how fast).
  transfer   `jax.experimental.transfer` through noloco_jax/asynchronous/transport.py's `exchange`
             (offer, a store flag, a pull with a watchdog): server start, the steady exchange, a partner
             that never offers (bounded by the exchange timeout), a partner that dies during the pull.
  kv         the coordination service's key-value store as a data plane (`key_value_set_bytes` /
             `blocking_key_value_get_bytes`: every byte through process 0).

Every steady figure is the median (and min, max) of --reps swaps, each started by a store barrier of
the two processes; a swap's time is the caller's, from the call to the partner's message on the host.

    python experiments/bench_async_transport.py --json
    python experiments/bench_async_transport.py --sizes_mb=4,40 --reps=8 --json

Prints one JSON object (the last line with --json); its "machine" says how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np

from experiments.lib import harness


def _summary(times):
  return {"median_s": float(np.median(times)), "min_s": float(np.min(times)), "max_s": float(np.max(times)),
          "reps": len(times)}


def child(args) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from noloco_jax.asynchronous import control, matchmaking, transport  # pylint: disable=g-import-not-at-top

  slot, count = int(os.environ["NOLOCO_PROCESS_ID"]), int(os.environ["NOLOCO_NUM_PROCESSES"])
  kv = control.initialize(os.environ["NOLOCO_COORDINATOR_ADDRESS"], count, slot, heartbeat_timeout_s=60)
  jax.devices()
  inc = control.incarnation()
  kv.set(f"bench/inc/{slot}", str(inc))
  t = time.perf_counter()
  tx = transport.Transport(kv, slot, inc)
  server_start_s = time.perf_counter() - t
  sizes = [float(s) for s in args.sizes_mb.split(",")]
  dev = jax.local_devices()[0]
  out: dict = {"slot": slot, "transfer_server_start_s": server_start_s}

  def barrier(name, members):
    kv.increment(f"bench/b/{name}", 1)
    while kv.increment(f"bench/b/{name}", 0) < len(members):
      time.sleep(0.002)

  def member(s):
    return matchmaking.Member(s, int(kv.wait(f"bench/inc/{s}", 120.0)), 0, 0)

  programs = {}

  def swap_program(a, b, n):
    # One program per (pair, shape): the mesh holds exactly the two processes' devices, so only they
    # run it; the ppermute is the swap. Compiled here, ahead of the first call, to time it apart.
    mesh = jax.sharding.Mesh(np.array([jax.devices()[a], jax.devices()[b]]), ("pair",))
    sharding = jax.NamedSharding(mesh, jax.P("pair"))
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "pair", [(0, 1), (1, 0)]), mesh=mesh,
                               in_specs=jax.P("pair"), out_specs=jax.P("pair")), out_shardings=sharding)
    spec = jax.ShapeDtypeStruct((2, n), jnp.float32, sharding=sharding)
    t = time.perf_counter()
    compiled = fn.lower(spec).compile()
    return compiled, sharding, time.perf_counter() - t

  def ppermute_swap(a, b, x_local):
    n = x_local.shape[-1]
    key = (a, b, n)
    compile_s = None
    if key not in programs:
      programs[key] = swap_program(a, b, n)
      compile_s = programs[key][2]
    compiled, sharding, _ = programs[key]
    arr = jax.make_array_from_single_device_arrays((2, n), sharding, [jax.device_put(x_local, dev)])
    t = time.perf_counter()
    got = np.asarray(compiled(arr).addressable_shards[0].data)
    return got, time.perf_counter() - t, compile_s

  # ---- (a) ppermute and (b) transfer and (c) kv, pair (0, 1) ----
  if slot in (0, 1):
    other = 1 - slot
    a, b = 0, 1
    for mb in sizes:
      n = int(mb * 2**20 / 4)
      x = np.full((1, n), float(slot), np.float32)
      rec = {}
      barrier(f"pp-first-{mb}", (0, 1))
      got, first_s, compile_s = ppermute_swap(a, b, x)
      assert got[0, 0] == other
      rec["compile_s"], rec["first_call_s"] = compile_s, first_s
      times = []
      for r in range(args.reps):
        barrier(f"pp-{mb}-{r}", (0, 1))
        got, dt, _ = ppermute_swap(a, b, x)
        assert got[0, -1] == other
        times.append(dt)
      rec["steady"] = _summary(times)
      rec["throughput_MBps_each_way"] = mb / rec["steady"]["median_s"]
      out.setdefault("ppermute", {})[str(mb)] = rec

      xj = jax.device_put(jnp.full((n,), float(slot), jnp.float32), dev)
      partner = member(other)
      rec = {}
      times = []
      for r in range(args.reps + 1):
        barrier(f"tx-{mb}-{r}", (0, 1))
        t = time.perf_counter()
        got = tx.exchange({"x": xj}, [partner], tag=int(mb * 1000) * 100 + r, timeout_s=60.0)
        v = float(got[0]["x"][-1])
        dt = time.perf_counter() - t
        assert v == other
        if r == 0:
          rec["first_exchange_s"] = dt  # includes connecting to the partner's server
        else:
          times.append(dt)
      rec["steady"] = _summary(times)
      rec["throughput_MBps_each_way"] = mb / rec["steady"]["median_s"]
      out.setdefault("transfer", {})[str(mb)] = rec

      raw = x.tobytes()
      rec = {}
      times = []
      try:
        for r in range(args.reps):
          barrier(f"kv-{mb}-{r}", (0, 1))
          t = time.perf_counter()
          kv.set_bytes(f"bench/kv/{mb}/{r}/{slot}", raw)
          theirs = kv.wait_bytes(f"bench/kv/{mb}/{r}/{other}", 60.0)
          got = np.frombuffer(theirs, np.float32)
          dt = time.perf_counter() - t
          assert got[-1] == other
          times.append(dt)
          barrier(f"kv-{mb}-{r}-done", (0, 1))
          kv.delete(f"bench/kv/{mb}/{r}/{slot}")
        rec["steady"] = _summary(times)
        rec["throughput_MBps_each_way"] = mb / rec["steady"]["median_s"]
      except Exception as e:  # pylint: disable=broad-except  (a size the service refuses is a result too)
        rec["error"] = str(e).splitlines()[0][:300]
      out.setdefault("kv", {})[str(mb)] = rec

  # ---- A second pair's first ppermute: a new program and a new rendezvous ----
  if slot in (0, 2):
    mb = sizes[0]
    n = int(mb * 2**20 / 4)
    barrier("pp-second-pair", (0, 2))
    got, first_s, compile_s = ppermute_swap(0, 2, np.full((1, n), float(slot), np.float32))
    out["ppermute_second_pair"] = {"size_mb": mb, "compile_s": compile_s, "first_call_s": first_s}

  # ---- A partner that calls late / never offers ----
  if slot in (0, 1):
    mb = sizes[0]
    n = int(mb * 2**20 / 4)
    barrier("late", (0, 1))
    if slot == 1:
      time.sleep(args.late_s)
    got, dt, _ = ppermute_swap(0, 1, np.full((1, n), float(slot), np.float32))
    if slot == 0:
      out["ppermute_partner_late"] = {"late_s": args.late_s, "caller_waited_s": dt}
      t = time.perf_counter()
      try:
        tx.exchange({"x": jnp.ones(n)}, [member(1)], tag=999_000, timeout_s=2.0)
        why = "no error"
      except transport.ExchangeFailed as e:
        why = str(e)
      out["transfer_partner_never_offers"] = {"timeout_s": 2.0, "caller_waited_s": time.perf_counter() - t, "error": why}
    barrier("late-done", (0, 1))
    # One side skips an exchange (process 1 makes its 2nd and 3rd calls as if the 2nd round had not
    # happened, then a 4th, late): what does process 0 receive, call by call?
    sent = [100.0, 110.0, 120.0] if slot == 0 else [200.0, 220.0, 240.0]
    got_values, waits = [], []
    for i, v in enumerate(sent):
      if slot == 1 and i == 2:
        time.sleep(args.late_s)
      got, dt, _ = ppermute_swap(0, 1, np.full((1, 8), v, np.float32))
      got_values.append(float(got[0, 0]))
      waits.append(dt)
    if slot == 0:
      out["ppermute_after_a_skip"] = {"sent": sent, "received": got_values, "waits_s": waits,
                                      "partner_skipped": "its round 2 (it sent 200 for round 1, 220 for round 3, "
                                                         f"240 for round 4, {args.late_s} s late)"}
    barrier("skip-done", (0, 1))

  # ---- A partner that dies during the exchange: slot 1 in a ppermute, slot 2 in a transfer ----
  big_n = int(max(sizes) * 2**20 / 4)
  if slot == 1:
    barrier("die-pp", (0, 1))
    threading.Timer(0.02, lambda: (kv.set("bench/died_pp", repr(time.time())), os.kill(os.getpid(), signal.SIGKILL))).start()
    ppermute_swap(0, 1, np.full((1, big_n), 1.0, np.float32))
    time.sleep(60)
  if slot == 0:
    barrier("die-pp", (0, 1))
    t = time.perf_counter()
    try:
      ppermute_swap(0, 1, np.full((1, big_n), 0.0, np.float32))
      why = "no error (the swap finished before the partner died)"
    except Exception as e:  # pylint: disable=broad-except
      why = str(e).splitlines()[0][:300]
    out["ppermute_partner_dies"] = {"size_mb": max(sizes), "caller_s": time.perf_counter() - t,
                                    "after_death_s": time.time() - float(kv.wait("bench/died_pp", 60.0)), "error": why}
  if slot == 2:
    big = jax.device_put(jnp.full((big_n,), 2.0, jnp.float32), dev)
    barrier("die-tx", (0, 2))
    tx.offer([big], 777_000, 0, 60.0)
    kv.set(f"x/777000/{slot}", transport.signature([big]))
    time.sleep(0.02)
    kv.set("bench/died_tx", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
  if slot == 0:
    big = jax.device_put(jnp.full((big_n,), 0.0, jnp.float32), dev)
    barrier("die-tx", (0, 2))
    t = time.perf_counter()
    try:
      tx.exchange({"x": big}, [member(2)], tag=777_000, timeout_s=60.0)
      why = "no error (the pull finished before the partner died)"
    except transport.ExchangeFailed as e:
      why = str(e)
    out["transfer_partner_dies"] = {"size_mb": max(sizes), "caller_s": time.perf_counter() - t,
                                    "after_death_s": time.time() - float(kv.wait("bench/died_tx", 60.0)), "error": why}
  with open(os.path.join(args.child, f"bench_{slot}.json"), "w") as f:
    json.dump(out, f)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


def main(argv=None) -> dict | None:
  bench = harness.Bench(__doc__)
  bench.add_argument("--sizes_mb", default="4,40", help="comma-separated message sizes, MB each way")
  bench.add_argument("--reps", type=int, default=8, help="steady swaps per size and method")
  bench.add_argument("--late_s", type=float, default=5.0, help="how late the partner calls in the late-partner case")
  bench.add_argument("--child", default=None, help=argparse.SUPPRESS)  # OUT_DIR: run as one process of the job
  args = bench.parse(argv)
  if args.child:
    child(args)
    return None
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as out:
    forwarded = [f"--sizes_mb={args.sizes_mb}", f"--reps={args.reps}", f"--late_s={args.late_s}", f"--child={out}"]
    start = time.time()
    job = launch_local.Job(3, 1, forwarded, script=os.path.abspath(__file__), log_dir=os.path.join(out, "logs"))
    codes = job.wait(timeout_s=900, grace_s=60)
    results = {}
    for slot in range(3):
      path = os.path.join(out, f"bench_{slot}.json")
      if os.path.exists(path):
        with open(path) as f:
          results[slot] = json.load(f)
    if 0 not in results:
      for name in sorted(os.listdir(os.path.join(out, "logs"))):
        with open(os.path.join(out, "logs", name)) as f:
          print(f.read()[-4000:], file=sys.stderr)
      raise SystemExit(f"bench_async_transport: process 0 wrote no result (exit statuses {codes}).")
  report = {"exit_statuses": codes, "wall_s": time.time() - start, "process_0": results[0],
            "process_1": results.get(1), "process_2": results.get(2)}
  return bench.finish(report, text=lambda r: json.dumps(r, indent=2))


if __name__ == "__main__":
  harness.run(main)
