"""The asynchronous schedule's two planes, measured: `--part=transport` (default) the data plane, three ways
to swap two messages; `--part=control` the etcd control plane beside JAX's coordination service.

**--part=transport.** Runs a job of three processes over loopback (one CPU device each) and measures, side by side in that
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

    python experiments/bench_async.py --json
    python experiments/bench_async.py --sizes_mb=4,40 --reps=8 --json

**--part=control.** Starts its own 3-member etcd cluster on 127.0.0.1 (scripts/etcd_local.py: data in
/dev/shm where it exists) and JAX's coordination service in this process, and measures, side by side:

  store_ops    p50/p90 of each store operation the protocol uses (set, get, increment, create, a wait on
               a key that exists, dir) from one client, on each store;
  matchmaking  `Matchmaker.ready` (window 0) for a pair of threads at equal speed (each its own client on
               etcd; one shared client on JAX's service), over --rounds rounds: every round pairs them;
  leader_loss  etcd only: the leader SIGKILLed, then how long the next increment takes from a client whose
               member was the leader (the election and the failover), and whether the data written before
               is there;
  lease        etcd only: a client stops renewing its lease (a crash): how long until another client sees
               its heartbeat key gone (the lease's TTL is ⌈--lease_s⌉ s).

    python experiments/bench_async.py --part=control --json

**--part=silence.** What a partner stopped in the middle of an exchange costs its survivor (issue 33 item 7):
two jobs of experiments/async_demo.py (two processes each, the config's defaults of outer.asynchronous:
max_wait_s 5, exchange_timeout_s 30, lease_s 10), side by side at once, one with the default
`partner_silence_s` and one with the bound off (1e9 s: the behaviour before it). In each, process 1 is
SIGSTOPped in its 3rd exchange right after announcing its message (`xstop ... at=announced`) for --stop_s
seconds; and, as a second case (`opener`), right after taking its ticket in the pairing before that
exchange, as the opener of the batch its partner joins (which waits for the opener's close: 5 s, then the
exchange). Per job: the survivor's (process 0's) round while it is stopped (status, reason, match wait,
time in the exchange, its state as before the round) and `lost_s`: mid-exchange, its time in that
exchange less its median exchange's; as the opener, that round's time (pairing and exchange) less its
median exchanged round's. Meanwhile, at the same load, the longest gap of a thread ticking every 0.05 s
(as the heartbeat beats) while this process traces and compiles a large program: a partner that compiles
is slow, not silent.

    python experiments/bench_async.py --part=silence --json

Everything runs on one machine: the etcd members' Raft traffic crosses loopback, not a network.

Prints one JSON object (the last line with --json); its "machine" says how busy the machine was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
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


# ---- --part=control: the etcd control plane ----


def _etcd_local():
  """scripts/etcd_local.py (a script, not a package module), loaded by path."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("etcd_local", os.path.join(root, "scripts", "etcd_local.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _pct(times):
  return {"p50_ms": 1e3 * float(np.median(times)), "p90_ms": 1e3 * float(np.percentile(times, 90)), "n": len(times)}


def store_ops(kv, ops: int) -> dict:
  kv.set("bench/present", "x")
  calls = {"set": lambda i: kv.set("bench/k", str(i)), "get": lambda i: kv.get("bench/k"),
           "increment": lambda i: kv.increment("bench/n", 1), "create": lambda i: kv.create(f"bench/c/{i}", "x"),
           "wait_present": lambda i: kv.wait("bench/present", 5.0), "dir": lambda i: kv.dir("bench/c/")}
  out = {}
  for name, call in calls.items():
    times = []
    for i in range(ops):
      start = time.perf_counter()
      call(i)
      times.append(time.perf_counter() - start)
    out[name] = _pct(times)
  return out


def matchmaking_rounds(kvs, rounds: int) -> dict:
  from noloco_jax.asynchronous import matchmaking  # pylint: disable=g-import-not-at-top
  """`ready` at equal speed: the threads start each round together (a barrier); p50/p90 and the skips."""
  live = {slot: slot + 1 for slot in range(len(kvs))}
  barrier = threading.Barrier(len(kvs))
  times, skipped = [], [0]
  lock = threading.Lock()

  def run(slot):
    mm = matchmaking.Matchmaker(kvs[slot], slot, slot + 1, seed=0, window_s=0.0, max_wait_s=10.0,
                                live=lambda: live)
    for r in range(rounds):
      barrier.wait(timeout=60)
      start = time.perf_counter()
      match = mm.ready(progress=r)
      with lock:
        times.append(time.perf_counter() - start)
        skipped[0] += match is None

  threads = [threading.Thread(target=run, args=(s,)) for s in range(len(kvs))]
  [t.start() for t in threads]
  [t.join(timeout=600) for t in threads]
  return {**_pct(times), "skipped": skipped[0]}


def control_main(bench, args) -> dict:
  """--part=control: the etcd control plane beside JAX's coordination service."""
  from noloco_jax.asynchronous import control, etcd_kv, matchmaking  # pylint: disable=g-import-not-at-top
  etcd_local = _etcd_local()
  etcd, why = etcd_local.ensure_etcd()
  if etcd is None:
    harness.usage_error(f"--part=control needs etcd: {why}")
  report = {"ops": args.ops, "rounds": args.rounds}
  # JAX's coordination service, in this process (one slot): the baseline.
  port = control._spare_port("127.0.0.1")  # pylint: disable=protected-access
  connection = control.connect(f"127.0.0.1:{port}", 1, 0, heartbeat_timeout_s=30, initialization_timeout_s=60)
  report["jax_service"] = {"store_ops": store_ops(connection.kv, args.ops),
                           "matchmaking": matchmaking_rounds([connection.kv] * 2, args.rounds)}
  with etcd_local.Cluster(3, etcd, tempfile.mkdtemp(prefix="bench_etcd_")).start() as cluster:
    endpoints = etcd_kv.parse_url(cluster.url())[0]
    make = lambda first=0, job="bench", lease_s=args.lease_s: etcd_kv.EtcdKV(
        endpoints[first:] + endpoints[:first], prefix=f"{control.NAMESPACE}{job}/", lease_s=lease_s)
    kv = make()
    kvs = [make(i, "mm") for i in range(2)]
    report["etcd"] = {"store_ops": store_ops(kv, args.ops), "matchmaking": matchmaking_rounds(kvs, args.rounds)}
    # A crash: the heartbeat key goes a TTL after the last renewal.
    crashed, observer = make(job="lease"), make(1, "lease")
    crashed.set("live/0", "1:1")
    crashed._stop.set()  # pylint: disable=protected-access  (no more renewals, no revoke)
    start = time.monotonic()
    gone = observer.wait_absent("live/0", 60.0)
    report["etcd"]["lease"] = {"ttl_s": crashed.ttl, "gone": gone, "seen_gone_after_s": time.monotonic() - start}
    # The leader dies, under a client that talks to it.
    kv.set("bench/before", "kept")
    leader = cluster.leader()
    on_leader = make(leader)
    on_leader.increment("bench/after", 1)
    cluster.kill(leader)
    start = time.monotonic()
    on_leader.increment("bench/after", 1)
    took = time.monotonic() - start
    report["etcd"]["leader_loss"] = {"next_increment_s": took, "kept": on_leader.get("bench/before") == "kept",
                                     "request_timeout_s": on_leader.request_timeout_s}
    for h in [kv, *kvs, observer, on_leader]:
      h.close()
  connection.client.shutdown()
  connection.service.shutdown()
  return bench.finish(report, text=lambda r: json.dumps(r, indent=2))



# ---- --part=silence: what a stopped partner costs its survivor ----

# Where process 1 is stopped: in its 3rd exchange right after announcing its message, or in the pairing
# before it, right after its ticket, as the opener of the batch (process 0 is 5x slower, so it always
# arrives second: a member, which waits for the opener's close).
SILENCE_CASES = {"mid_exchange": ("announced", 0.02), "opener": ("ticketed", 0.1)}


def _stopped_partner_job(out: str, silence_s: float, stop_s: float, case: str):
  """experiments/async_demo.py on two processes (the config's asynchronous defaults, `silence_s` as the bound),
  process 1 stopped for `stop_s` at SILENCE_CASES[case]; returns its processes (started) and their logs."""
  from noloco_jax.config.outer import AsyncConfig  # pylint: disable=g-import-not-at-top
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  d, (at, slow_step_s) = AsyncConfig(), SILENCE_CASES[case]
  os.makedirs(os.path.join(out, "logs"))
  common = ["--log_dir", out, "--max_wait_s", str(d.max_wait_s), "--window_s", str(d.match_window_s),
            "--exchange_timeout_s", str(d.exchange_timeout_s), "--lease_s", str(d.lease_s),
            "--partner_silence_s", str(silence_s), "--dim", "1024", "--linger_s", str(stop_s + 120),
            "--heartbeat_timeout_s", str(int(stop_s) + 60)]  # the service must not hold the stopped process dead
  per_slot = [["--run_s", str(stop_s + 300), "--until_file", os.path.join(out, "result_1.json"), "--rounds", "1",
               "--step_s", str(slow_step_s)], ["--rounds", "6", "--step_s", "0.02"]]
  env = {"NOLOCO_FAULTS": f"xstop:process=1,round=3,at={at},seconds={stop_s:g}"}
  port, procs = launch_local.free_port(), []
  for slot, flags in enumerate(per_slot):
    log = open(os.path.join(out, "logs", f"process_{slot}.log"), "w")
    procs.append((subprocess.Popen([sys.executable, "-m", "experiments.async_demo", *common, *flags],
                                   env=launch_local.process_env(slot, 2, 1, port, env), cwd=harness.REPO,
                                   stdout=log, stderr=subprocess.STDOUT), log))
  return procs


def _jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _survivor(out: str, case: str) -> dict:
  """Process 0's round while process 1 was stopped (the first it ended after process 1's last round before
  the stop, in another batch), against its exchanged rounds. Its loss: mid-exchange, the exchange's time
  (the stop came after the pairing) less a normal exchange's; stopped as the opener, the whole round's
  (the pairing, then any exchange) less a normal round's."""
  rows = {slot: _jsonl(os.path.join(out, f"pairings_{slot}.jsonl")) for slot in (0, 1)}
  tried = [i for i, p in enumerate(rows[1]) if p["status"] in ("exchanged", "failed")]
  before, stopped = rows[1][tried[1]], rows[1][tried[1] + 1]  # its 2nd exchange; the round of the stop
  hit = next(p for p in rows[0] if p["time"] > before["time"] and p["batch"] != before["batch"])
  counted = (lambda p: p["exchange_s"]) if case == "mid_exchange" else (lambda p: p["waited_s"] + p["exchange_s"])
  normal = [counted(p) for p in rows[0] if p["status"] == "exchanged"]
  median = float(np.median(normal))
  [state] = [r for r in _jsonl(os.path.join(out, "rounds_0.jsonl")) if r["step"] == hit["step"]]
  return {"round": {k: hit[k] for k in ("status", "reason", "waited_s", "exchange_s")},
          "state_as_before_round": state["after"] == state["before"],
          "stopped_process_round": {k: stopped[k] for k in ("status", "reason")},
          "normal_s": {"median": median, "rounds": len(normal),
                       "of": "exchange_s" if case == "mid_exchange" else "waited_s + exchange_s"},
          "lost_s": counted(hit) - median}


def _tick_gap_during_compile(ops: int = 1500, tick_s: float = 0.05) -> dict:
  """While this thread traces and compiles a program of `ops` elementwise steps, how long a thread that ticks
  every `tick_s` (as the heartbeat beats: liveness.Liveness._run) goes at most without a tick."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ticks, stop = [time.monotonic()], threading.Event()

  def tick():
    while not stop.wait(tick_s):
      ticks.append(time.monotonic())

  def program(x):
    for i in range(ops):
      x = jnp.sin(x) * 1.0001 + jnp.cos(x * i)
    return x

  ticker = threading.Thread(target=tick, daemon=True)
  ticker.start()
  start = time.monotonic()
  jax.jit(program).lower(jnp.ones((64, 64))).compile()
  compile_s = time.monotonic() - start
  stop.set()
  ticker.join()
  return {"compile_s": compile_s, "tick_s": tick_s, "max_gap_s": float(np.max(np.diff(ticks)))}


def silence_main(bench, args) -> dict:
  """--part=silence: the survivor's loss with the default partner_silence_s beside the bound off, per case."""
  from noloco_jax.config.outer import AsyncConfig  # pylint: disable=g-import-not-at-top
  arms = {"partner_silence_s_default": AsyncConfig().partner_silence_s, "bound_off": 1e9}
  runs = [(case, arm) for case in args.cases for arm in arms]
  with tempfile.TemporaryDirectory() as out:
    # Every job at once: each arm sees the same load.
    jobs = {run: _stopped_partner_job(os.path.join(out, *run), arms[run[1]], args.stop_s, run[0]) for run in runs}
    # Meanwhile, at the same load: is a thread starved while its process compiles (a slow, not a silent, partner)?
    gap = _tick_gap_during_compile()
    codes = {}
    for run, procs in jobs.items():
      codes["/".join(run)] = []
      for proc, log in procs:
        try:
          codes["/".join(run)].append(proc.wait(timeout=args.stop_s + 600))
        finally:
          if proc.poll() is None:
            proc.kill()
          log.close()
    report = {"stop_s": args.stop_s, "defaults": dataclasses.asdict(AsyncConfig()), "exit_statuses": codes,
              "heartbeat_thread_during_compile": gap}
    for case, arm in runs:
      try:
        report.setdefault(case, {})[arm] = {"partner_silence_s": arms[arm], **_survivor(os.path.join(out, case, arm), case)}
      except (OSError, ValueError, IndexError, StopIteration) as e:
        for log in sorted(os.listdir(os.path.join(out, case, arm, "logs"))):
          with open(os.path.join(out, case, arm, "logs", log)) as f:
            print(f.read()[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_async --part=silence: job {case}/{arm} left no round with the stopped process ({e}).")
  return bench.finish(report, text=lambda r: json.dumps(r, indent=2))


def main(argv=None) -> dict | None:
  bench = harness.Bench(__doc__)
  bench.add_argument("--part", choices=("transport", "control", "silence"), default="transport",
                     help="transport: the data plane (three ways to swap); control: etcd beside JAX's service; "
                     "silence: a partner stopped mid-exchange, with and without partner_silence_s")
  bench.add_argument("--stop_s", type=float, default=40.0,
                     help="--part=silence: how long the partner is stopped (past exchange_timeout_s: 30)")
  bench.add_argument("--cases", nargs="+", choices=tuple(SILENCE_CASES), default=list(SILENCE_CASES),
                     help="--part=silence: where the partner is stopped")
  bench.add_argument("--ops", type=int, default=200, help="--part=control: calls per store operation")
  bench.add_argument("--rounds", type=int, default=50, help="--part=control: matchmaking rounds")
  bench.add_argument("--lease_s", type=float, default=3.0, help="--part=control: the etcd lease's TTL")
  bench.add_argument("--sizes_mb", default="4,40", help="comma-separated message sizes, MB each way")
  bench.add_argument("--reps", type=int, default=8, help="steady swaps per size and method")
  bench.add_argument("--late_s", type=float, default=5.0, help="how late the partner calls in the late-partner case")
  bench.add_argument("--child", default=None, help=argparse.SUPPRESS)  # OUT_DIR: run as one process of the job
  args = bench.parse(argv)
  if args.child:
    child(args)
    return None
  if args.part == "control":
    return control_main(bench, args)
  if args.part == "silence":
    return silence_main(bench, args)
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
      raise SystemExit(f"bench_async: process 0 wrote no result (exit statuses {codes}).")
  report = {"exit_statuses": codes, "wall_s": time.time() - start, "process_0": results[0],
            "process_1": results.get(1), "process_2": results.get(2)}
  return bench.finish(report, text=lambda r: json.dumps(r, indent=2))


if __name__ == "__main__":
  harness.run(main)
