"""One process of the multi-process tests of noloco_jax/asynchronous/, and `launch`, which starts a job of them.

    python tests/async_child.py MODE OUT_DIR [args]      (what launch_local.Job runs in each process)

Modes (each process writes OUT_DIR/<mode>_<slot>.json):
  kv        the store's atomic operations from every process at once (create race, increments, a wait
            that times out, dir)
  lease     liveness: the last slot kills itself (SIGKILL) once every lease is seen, slot 1 leaves
            normally a little later; the others record when they see each go
  exchange  transport: rounds of exchanges of a 4 MB message in the group the matchmaker forms, then
            (args: "absent") slot 1 stays away from an exchange it was matched for, then slot 1 is killed
            while slot 0 waits for it
  match     matchmaking only: many rounds at equal speed; every process logs the groups it got
"""

import json
import os
import signal
import sys
import time

from noloco_jax.asynchronous import control, liveness, matchmaking

MODE = OUT = ARGS = SLOT = COUNT = None  # set by __main__


def launch(mode: str, num_processes: int, out_dir, *args, timeout_s: float) -> tuple[list[int], dict]:
  """Runs a job of `num_processes` children in `mode`; returns (exit statuses, {slot: result dict})."""
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  out_dir = str(out_dir)
  job = launch_local.Job(num_processes, 1, [mode, out_dir, *map(str, args)], script=os.path.abspath(__file__),
                         log_dir=os.path.join(out_dir, f"logs_{mode}"))
  codes = job.wait(timeout_s=timeout_s, grace_s=30)
  results = {}
  for slot in range(num_processes):
    path = os.path.join(out_dir, f"{mode}_{slot}.json")
    if os.path.exists(path):
      with open(path) as f:
        results[slot] = json.load(f)
  return codes, results


def logs(out_dir, mode: str) -> str:
  """Every process's log of a `launch`, for assertion messages."""
  d = os.path.join(str(out_dir), f"logs_{mode}")
  return "\n".join(f"--- {n}\n" + open(os.path.join(d, n)).read()[-3000:] for n in sorted(os.listdir(d)))


def write(result):
  with open(os.path.join(OUT, f"{MODE}_{SLOT}.json"), "w") as f:
    json.dump(result, f)


def barrier(kv, name, count=None, timeout_s=120.0):
  """Everyone arrives (a counter), then goes: a barrier on the store that any subset can use."""
  count = COUNT if count is None else count
  kv.increment(f"test/{name}", 1)
  end = time.monotonic() + timeout_s
  while kv.increment(f"test/{name}", 0) < count:
    if time.monotonic() > end:
      raise TimeoutError(f"barrier {name}")
    time.sleep(0.02)


def finish(kv, expect):
  """Slot 0 hosts the coordination service: it leaves last, once the others have written their results."""
  kv.increment("test/done", 1)
  if SLOT == 0:
    end = time.monotonic() + 120
    while kv.increment("test/done", 0) < expect and time.monotonic() < end:
      time.sleep(0.05)
  sys.stdout.flush()
  os._exit(0)


def mode_kv(kv):
  barrier(kv, "start")
  won = kv.create("race", str(SLOT))
  for _ in range(10):
    kv.increment("counter", 1)
  start = time.monotonic()
  missing = kv.wait("never-written", 1.0)
  waited = time.monotonic() - start
  barrier(kv, "counted")
  write({"won": won, "winner": kv.get("race"), "counter": kv.increment("counter", 0), "missing": missing,
         "wait_s": waited, "absent_get": kv.get("absent"), "dir": sorted(kv.dir("test/"))})
  finish(kv, COUNT)


def mode_lease(kv):
  lease_s = float(ARGS[0])
  me = liveness.Liveness(kv, SLOT, control.incarnation(), beat_s=lease_s / 10, lease_s=lease_s).start()
  victim, leaver = COUNT - 1, 1
  end = time.monotonic() + 60
  while len(me.poll()) < COUNT and time.monotonic() < end:
    time.sleep(0.05)
  barrier(kv, "all-seen")
  if SLOT == victim:
    kv.set("test/killed_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
  if SLOT == leaver:
    time.sleep(1.0)
    kv.set("test/left_at", repr(time.time()))
    me.leave()
    write({"events": me.events})
    finish(kv, COUNT - 1)
  seen = {}
  end = time.monotonic() + 4 * lease_s + 30
  while len(seen) < 2 and time.monotonic() < end:
    me.poll()
    for e in me.events:
      if e["event"] in ("lost", "left") and e["slot"] not in seen:
        seen[e["slot"]] = e
    time.sleep(0.05)
  write({"events": me.events, "alive": sorted(me.poll()), "killed_at": float(kv.get("test/killed_at")),
         "left_at": float(kv.get("test/left_at") or "nan")})
  finish(kv, COUNT - 1)


def mode_exchange(kv):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from noloco_jax.asynchronous import transport  # pylint: disable=g-import-not-at-top
  inc = control.incarnation()
  live = liveness.Liveness(kv, SLOT, inc, beat_s=0.25, lease_s=5.0).start()
  mm = matchmaking.Matchmaker(kv, SLOT, inc, seed=0, window_s=0.2, max_wait_s=5.0, live=live.poll)
  tx = transport.Transport(kv, SLOT, inc)
  barrier(kv, "servers")
  rounds = []
  for r in range(4):
    x = jnp.full((2 ** 20,), float(100 * SLOT + r), jnp.float32)  # 4 MB; its value says who sent it, when
    m = mm.ready(r)  # progress = the round: a receiver knows which message to expect
    if m is None:
      rounds.append(None)
      continue
    start = time.monotonic()
    got = tx.exchange({"x": x}, m.partners, m.batch, timeout_s=60.0)
    rounds.append({"batch": m.batch, "group": [p.slot for p in m.group], "seconds": time.monotonic() - start,
                   "received": {str(p.slot): [p.progress, float(g["x"][0]), float(g["x"][-1]), int(g["x"].size)]
                                for p, g in zip(m.partners, got)}})
  barrier(kv, "rounds")
  result = {"rounds": rounds}
  if SLOT in (0, 1):
    # Slot 0 and 1 are matched by hand (batch tags far from the matchmaker's): 1 never offers.
    kv.set(f"test/inc/{SLOT}", str(inc))
    other = int(kv.wait(f"test/inc/{1 - SLOT}", 60.0))
    partner = matchmaking.Member(1 - SLOT, other, 0, 0)
    x = jnp.ones((2 ** 20,), jnp.float32)
    if SLOT == 0:
      start = time.monotonic()
      try:
        tx.exchange({"x": x}, [partner], 1 << 30, timeout_s=3.0)
        result["absent"] = "no error"
      except transport.ExchangeFailed as e:
        result["absent"] = str(e)
      result["absent_s"] = time.monotonic() - start
      # A partner that offers (so the pull starts) and is killed while slot 0 pulls a larger message.
      kv.set("test/pull-now", "1")
      big = jnp.ones((16 * 2 ** 20,), jnp.float32)  # 64 MB: long enough to be killed in the middle
      start = time.monotonic()
      try:
        tx.exchange({"x": big}, [partner], (1 << 30) + 1, timeout_s=60.0)
        result["killed"] = "no error"
      except transport.ExchangeFailed as e:
        result["killed"] = str(e)
      result["killed_s"] = time.monotonic() - start
      result["killed_at"] = float(kv.get("test/killed_at") or "nan")
      result["failed_at"] = time.time()
    else:
      kv.wait("test/pull-now", 60.0)
      big = jnp.ones((16 * 2 ** 20,), jnp.float32)
      tx.offer(jax.tree.leaves({"x": big}), (1 << 30) + 1, 0, 60.0)
      kv.set(f"x/{(1 << 30) + 1}/{SLOT}", transport.signature([big]))
      time.sleep(0.05)  # slot 0 is pulling now
      kv.set("test/killed_at", repr(time.time()))
      os.kill(os.getpid(), signal.SIGKILL)
  result["stats"] = tx.stats.as_dict()
  write(result)
  finish(kv, COUNT - 1)


def mode_match(kv):
  rounds, window_s = int(ARGS[0]), float(ARGS[1])
  inc = control.incarnation()
  live = liveness.Liveness(kv, SLOT, inc, beat_s=0.5, lease_s=30.0).start()
  end = time.monotonic() + 60
  while len(live.poll()) < COUNT and time.monotonic() < end:
    time.sleep(0.05)
  mm = matchmaking.Matchmaker(kv, SLOT, inc, seed=int(ARGS[2]), window_s=window_s, max_wait_s=30.0, live=live.poll)
  barrier(kv, "start")
  got = []
  for r in range(rounds):
    m = mm.ready(r)
    got.append(None if m is None else [m.batch, [p.slot for p in m.group]])
  write({"groups": got, "stats": mm.stats.as_dict()})
  finish(kv, COUNT)


if __name__ == "__main__":
  MODE, OUT, ARGS = sys.argv[1], sys.argv[2], sys.argv[3:]
  SLOT, COUNT = int(os.environ["NOLOCO_PROCESS_ID"]), int(os.environ["NOLOCO_NUM_PROCESSES"])
  kv_ = control.initialize(os.environ["NOLOCO_COORDINATOR_ADDRESS"], COUNT, SLOT, heartbeat_timeout_s=60)
  import jax  # pylint: disable=g-import-not-at-top
  jax.devices()  # every process starts its backend (the others' start waits for it)
  {"kv": mode_kv, "lease": mode_lease, "exchange": mode_exchange, "match": mode_match}[MODE](kv_)
