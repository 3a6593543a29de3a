"""Live churn (asynchronous/churn.py, session.py) on real processes: with the coordination service in a
process of its own even process 0 can die, and a new process joins through a reserved slot.

The job runs the toy of experiments/async_demo.py (a vector per process, real exchanges, the real update),
killed with NOLOCO_FAULTS; it takes 20–50 s on a 2-core machine, quiet to loaded (most of it starting JAX
in every process); timeouts allow several times that. A killed process left behind and its restart joining from a
live peer are tested on the trainer itself (tests/test_async_driver.py).
"""

import collections
import json
import os
import subprocess
import sys
import time

import numpy as np
from scipy import stats

from configs import default
from noloco_jax.asynchronous import churn
from noloco_jax.outer import methods
from noloco_jax.runtime import launch_local

import memory_kv  # pylint: disable=g-bad-import-order  (tests/memory_kv.py)

DEMO = "experiments.async_demo"


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _wait_for_event(out, slots, event, timeout_s):
  """Until every process of `slots` has logged `event` (slot, name) in its membership_<slot>.jsonl."""
  end = time.monotonic() + timeout_s
  while True:
    paths = {slot: os.path.join(out, f"membership_{slot}.jsonl") for slot in slots}
    seen = {slot: [(e["slot"], e["event"]) for e in _jsonl(path) if "slot" in e] if os.path.exists(path) else []
            for slot, path in paths.items()}
    if all(event in events for events in seen.values()):
      return
    assert time.monotonic() < end, f"after {timeout_s} s, {event} not logged by every one of {slots}: {seen}"
    time.sleep(0.5)


def _result(out, slot):
  with open(os.path.join(out, f"result_{slot}.json")) as f:
    return json.load(f)


def _logs(out):
  d = os.path.join(out, "logs")
  return "\n".join(f"--- {n}\n" + open(os.path.join(d, n)).read()[-3000:] for n in sorted(os.listdir(d)))


def test_a_joiner_starts_by_the_methods_elastic_grow_rule():
  """What a (re)started process makes of the state it copied (the method's new_replica, as
  checkpoint.elastic=grow): θ = φ = φ_peer, δ = 0; the driver keeps the peer's inner optimizer state."""
  method = methods.make(default.get_config().outer)
  peer_phi = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
  params, outer = method.new_replica({"w": np.ones((2, 3), np.float32)},
                                     {"slow": peer_phi, "momentum": {"w": np.ones((2, 3), np.float32)}})
  np.testing.assert_array_equal(params["w"], peer_phi["w"])
  np.testing.assert_array_equal(outer["slow"]["w"], peer_phi["w"])
  np.testing.assert_array_equal(outer["momentum"]["w"], np.zeros((2, 3)))


def test_the_first_donor_is_uniform_over_the_live_peers():
  firsts = collections.Counter(churn.donor_order([0, 1, 2, 3, 4], 2, seed=3, incarnation=i)[0] for i in range(2000))
  assert set(firsts) == {0, 1, 3, 4}
  assert stats.chisquare(list(firsts.values())).pvalue > 0.01
  assert sorted(churn.donor_order([0, 1, 2, 3, 4], 2, seed=3, incarnation=7)) == [0, 1, 3, 4]


class _OfferLog:
  """A transport that records offers (the Donor's side of a join needs nothing else)."""
  incarnation = 5

  def __init__(self):
    self.offers = []

  def offer(self, leaves, tag, puller, expiry_s):
    self.offers.append((tag, puller))


def test_a_donor_serves_a_joiner_that_comes_back():
  """A joiner that joined from this donor once, failed again and asks it again (the same key, a new tag)
  is served again. Seen under churn before the fix: the donor took the second request for the first, never
  served it, and the joiner waited until the donor itself was restarted (26 s)."""
  kv, transport = memory_kv.MemoryKV(), _OfferLog()
  donor = churn.Donor(kv, transport, slot=0)
  for tag in (10, 11):
    kv.set("join/0/3", json.dumps({"incarnation": tag * 7, "tag": tag}))
    assert donor.serve(lambda: {"w": np.zeros(2)}, progress=4) == 1
    assert json.loads(kv.get(f"joinok/3/{tag}"))["donor"] == 0
    assert donor.serve(lambda: {"w": np.zeros(2)}, progress=4) == 0  # served once: not again
    kv.delete("join/0/3")  # what the joiner does once it has pulled
  assert transport.offers == [(10, 3), (11, 3)]


def test_peers_that_are_joining_themselves_are_tried_last():
  """A joiner serves no one until it has joined: a peer whose own request is posted goes to the end of the
  seeded order (not out of it: if every peer is joining, one of them will serve once it has joined)."""
  kv = memory_kv.MemoryKV()
  kv.increment("join/tags", 1)  # the tag counter lives beside the requests and names no slot
  kv.set("join/4/1", "{}")  # slot 1 asked slot 4
  kv.set("joinok/2/9", "{}")  # an answer, not a request
  assert churn.joining(kv) == {1}
  order = churn.donor_order([0, 1, 2, 4, 5], 3, seed=0, incarnation=2)
  assert churn.settled_first(order, {1}) == [s for s in order if s != 1] + [1]
  assert churn.settled_first(order, {0, 1, 2, 4, 5}) == order


def test_process_0_can_die_and_a_new_process_joins_through_a_reserved_slot(tmp_path):
  """Four slots: the coordination service runs in a process of its own (`python -m
  noloco_jax.asynchronous.control --port`), slots 0–2 train, slot 3 is reserved at start-up
  (`--reserve_slot`: jax.distributed cannot start with a process missing nor grow later). Process 0 is
  killed mid-run: with the service elsewhere the others train on (hosting it, its exit would end them).
  Then a new process takes slot 3, copies a live peer and pairs with the survivors."""
  out = str(tmp_path)
  os.makedirs(os.path.join(out, "logs"))
  port = launch_local.free_port()
  common = ["--log_dir", out, "--rounds", "4", "--lease_s", "4", "--max_wait_s", "2", "--exchange_timeout_s", "10",
            "--standalone_service"]
  service = subprocess.Popen([sys.executable, "-m", "noloco_jax.asynchronous.control", f"--port={port}",
                              "--num_processes=4"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
  procs, logs = [], []
  try:
    assert "coordination service for 4 processes" in service.stdout.readline()
    for slot in range(3):
      env = launch_local.process_env(slot, 4, 1, port, {"NOLOCO_FAULTS": "kill:process=0,step=20"})
      log = open(os.path.join(out, "logs", f"process_{slot}.log"), "w")
      logs.append(log)
      # The survivors train until the newcomer has finished (its result file), not for a fixed time: the
      # newcomer must find them training however long JAX takes to start under load; 200 s is a hang.
      procs.append(subprocess.Popen([sys.executable, "-m", DEMO, *common, "--run_s", "200", "--until_file",
                                     os.path.join(out, "result_3.json")], env=env, stdout=log, stderr=subprocess.STDOUT))
    reserve = subprocess.run([sys.executable, "-m", "noloco_jax.asynchronous.control", "--num_processes=4",
                              "--reserve_slot=3", f"--coordinator_address=127.0.0.1:{port}", "--standalone_service"],
                             env=launch_local.process_env(3, 4, 1, port), capture_output=True, text=True, timeout=240)
    assert reserve.returncode == 0, reserve.stdout + reserve.stderr
    assert procs[0].wait(timeout=240) == -9, _logs(out)
    # The survivors see process 0 lost (its lease, 4 s, runs out) before the newcomer comes: on a quiet
    # machine the newcomer could join, run and finish (which ends the survivors) within the lease.
    _wait_for_event(out, (1, 2), (0, "lost"), timeout_s=120)
    with open(os.path.join(out, "logs", "process_3.log"), "w") as log:
      new = subprocess.run([sys.executable, "-m", DEMO, *common, "--run_s", "3", "--join"],
                           env=launch_local.process_env(3, 4, 1, port), stdout=log, stderr=subprocess.STDOUT, timeout=240)
    assert new.returncode == 0, _logs(out)
    assert [p.wait(timeout=240) for p in procs[1:]] == [0, 0], _logs(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    service.terminate()
    service.wait(timeout=30)
    for log in logs:
      log.close()
  dead = _jsonl(os.path.join(out, "pairings_0.jsonl"))[-1]
  newcomer = _result(out, 3)
  assert newcomer["joined_from"] in (1, 2) and newcomer["matchmaking"]["matched"] > 0
  for slot in (1, 2):
    events = [(e["slot"], e["event"]) for e in _jsonl(os.path.join(out, f"membership_{slot}.jsonl")) if "slot" in e]
    assert (0, "lost") in events and (3, "joined") in events, events
    pairings = _jsonl(os.path.join(out, f"pairings_{slot}.jsonl"))
    later = [p for p in pairings if p["time"] > dead["time"] + 1.0 and p["status"] == "exchanged"]
    assert later and all(dead["incarnation"] not in p["incarnations"] for p in later)
    assert _result(out, slot)["rounds"] > 4
  with_new = [p for s in (1, 2) for p in _jsonl(os.path.join(out, f"pairings_{s}.jsonl"))
              if p["status"] == "exchanged" and newcomer["incarnation"] in p["incarnations"]]
  assert with_new, "the new process never exchanged with the others"
