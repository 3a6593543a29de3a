"""The etcd control plane (asynchronous/etcd_kv.py; docs/async.md §5).

Default tier: the --control URL, the layout checks of a job on etcd or on JAX's service (growth refused
there in one line), a member that does not answer (Unavailable naming it, within a bounded time).

Real tier (`@pytest.mark.real`, bash scripts/test_real.sh): each test starts its own etcd members on
127.0.0.1 (scripts/etcd_local.py; Debian's etcd-server installed with apt-get as root where missing, else
skipped with one line) and stops them. The KV contract (tests/kv_contract.py, also run on MemoryKV and
JaxKV), lease expiry, a watch's wake-up, one winner among racing creators and slot claims, the store
through the loss of its leader, the command line's answer to an endpoint that does not answer; and one
job through all of it: four processes training, the etcd leader killed (they train on, none restarted),
two processes that were never part of the job join it in free slots and pair (4 → 6), then leave (6 → 4).
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import kv_contract
from configs import default
from noloco_jax import config as config_lib
from noloco_jax.asynchronous import control, etcd_kv
from noloco_jax.asynchronous import job as job_lib
from noloco_jax.runtime import launch_local
from noloco_jax.runtime import options as options_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("etcd_local", os.path.join(ROOT, "scripts", "etcd_local.py"))
etcd_local = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(etcd_local)


def _config(**overrides):
  cfg = default.get_config("smoke")
  cfg.outer.schedule = "async"
  for key, value in overrides.items():
    cfg[key] = value
  return config_lib.load(cfg)


# ---- Without etcd ----


def test_the_control_url_names_members_and_job():
  assert etcd_kv.parse_url("etcd://10.0.0.1:2379,h2:2380/run-7") == ([("10.0.0.1", 2379), ("h2", 2380)], "run-7")
  assert etcd_kv.parse_url("etcd://127.0.0.1:2379") == ([("127.0.0.1", 2379)], "default")
  for bad in ("etcd://host", "etcd://h:99999", "http://h:2379", "etcd://h:2379/a b"):
    with pytest.raises(ValueError, match=r"^--control=.* is not valid") as e:
      etcd_kv.parse_url(bad)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"^--control='zookeeper' is not valid: 'jax'"):
    options_lib.resolve_options(environ={"NOLOCO_CONTROL": "zookeeper"})
  assert options_lib.resolve_options(environ={"NOLOCO_CONTROL": "etcd://h:1"}).control == "etcd://h:1"


def test_a_job_on_etcd_holds_up_to_num_replicas_processes_and_jax_s_service_refuses_to_grow():
  config = _config(num_replicas=6)
  etcd = "etcd://127.0.0.1:2379"
  job_lib.check_layout(config, 4, control_plane=etcd)  # starts with 4 of at most 6
  job_lib.check_layout(config, None, process_id=None, control_plane=etcd)  # a newcomer
  with pytest.raises(config_lib.ConfigError, match=r"^config.num_replicas=6 is not valid: ≥ 7, the processes"):
    job_lib.check_layout(config, 7, control_plane=etcd)
  with pytest.raises(config_lib.ConfigError, match=r"^--process_id=6 is not valid: a slot in \[0, 5\]"):
    job_lib.check_layout(config, None, process_id=6, control_plane=etcd)
  # JAX's service: fixed slots. Asked to grow, one line that says how to.
  with pytest.raises(config_lib.ConfigError, match=r"^config.num_replicas=6 is not valid: 4, the number of processes.*"
                     r"cannot grow.*--control=etcd://") as e:
    job_lib.check_layout(config, 4)
  assert "\n" not in str(e.value)
  with pytest.raises(config_lib.ConfigError, match=r"^--process_id=4 is not valid with JAX's coordination service: a "
                     r"slot in \[0, 3\]; the service holds the 4 processes it started with and cannot grow") as e:
    job_lib.check_layout(_config(num_replicas=4), 4, process_id=4)
  assert "\n" not in str(e.value)


def test_a_process_without_an_id_on_jax_s_service_is_one_line_that_points_to_etcd(capsys):
  from noloco_jax.runtime import distributed  # pylint: disable=g-import-not-at-top  (imports JAX)
  options = options_lib.resolve_options(environ={}, coordinator_address="127.0.0.1:1", num_processes=4)
  with pytest.raises(SystemExit) as e:
    distributed.process_coordinates(options)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert err[0].startswith("noloco_jax: config.outer.schedule='async' needs the job's")
  assert "--control=etcd://" in err[0]


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_a_member_that_does_not_answer_is_named_within_a_bounded_time(kind):
  """No etcd at the endpoint: a closed port (refused at once) or a socket that accepts and never answers
  (each request ends at its timeout). Either way: Unavailable within the start-up budget, naming it."""
  pytest.importorskip("etcd3gw")
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  port = listener.getsockname()[1]
  if kind == "silent":
    listener.listen(16)
  else:
    listener.close()
  start = time.monotonic()
  try:
    with pytest.raises(etcd_kv.Unavailable) as e:
      etcd_kv.EtcdKV([("127.0.0.1", port)], prefix="t/", lease_s=3, request_timeout_s=1.0, startup_s=3.0)
  finally:
    listener.close()
  took = time.monotonic() - start
  assert 3.0 <= took < 3.0 + 1.0 + 10.0, took  # the budget, plus at most one request's timeout (and load)
  message = str(e.value)
  assert "\n" not in message and f"127.0.0.1:{port}: " in message, message
  assert ("connection refused" if kind == "refused" else "no answer in time") in message, message


# ---- With a real etcd cluster ----


def _etcd_binary():
  etcd, why = etcd_local.ensure_etcd()
  if etcd is None:
    pytest.skip(f"etcd: {why}")
  pytest.importorskip("etcd3gw", reason="the etcd client (pip install 'noloco_jax[etcd]')")
  return etcd


@pytest.fixture
def cluster(tmp_path):
  """Three etcd members of this test's own, stopped (and their data removed) at its end."""
  with etcd_local.Cluster(3, _etcd_binary(), str(tmp_path / "etcd")).start() as c:
    yield c


def _kv(cluster, job="t", first=0, **kwargs):
  endpoints = etcd_kv.parse_url(cluster.url())[0]
  endpoints = endpoints[first:] + endpoints[:first]  # each handle starts at another member
  return etcd_kv.EtcdKV(endpoints, prefix=f"{control.NAMESPACE}{job}/", **{"lease_s": 3, **kwargs})


@pytest.mark.real
def test_etcd_kv_keeps_the_kv_contract(cluster):
  handles = []
  def make():
    handles.append(_kv(cluster, first=len(handles)))
    return handles[-1]
  try:
    kv_contract.check(make)
  finally:
    for h in handles:
      h.close()


@pytest.mark.real
def test_a_process_s_keys_go_with_its_lease_and_a_watch_wakes_its_waiter(cluster):
  a, b = _kv(cluster, lease_s=3), _kv(cluster, first=1)
  # A watch, not a poll: the waiter wakes on the write, well before the re-read every WATCH_CHUNK_S.
  threading.Timer(0.3, lambda: b.set("mm/b/0", "record")).start()
  start = time.monotonic()
  assert a.wait("mm/b/0", 30.0) == "record"
  assert time.monotonic() - start < 0.3 + etcd_kv.WATCH_CHUNK_S * 0.75
  # Its heartbeat and address are bound to its lease; a record it wrote is not.
  a.set("live/0", f"{a.incarnation}:1")
  a.set("tx/0", "address")
  a.set("mm/t/1", "ticket")
  assert b.dir("live/") == {"live/0": f"{a.incarnation}:1"}
  a._stop.set()  # pylint: disable=protected-access  (its lease is no longer renewed: a crash)
  crashed = time.monotonic()
  assert b.wait_absent("live/0", 30.0) and b.get("tx/0") is None
  gone_after = time.monotonic() - crashed
  assert a.ttl - a.ttl / 3 - 0.5 < gone_after < a.ttl + 10.0, gone_after  # from its last renewal: one TTL
  assert b.get("mm/t/1") == "ticket"
  # Leaving revokes the lease: its keys go at once.
  c = _kv(cluster, first=2, lease_s=30)
  c.set("live/2", f"{c.incarnation}:1")
  start = time.monotonic()
  c.close()
  assert b.get("live/2") is None and time.monotonic() - start < 5.0
  b.close()


@pytest.mark.real
def test_racing_processes_claim_distinct_slots_and_the_full_job_refuses_one_more(cluster):
  """Four newcomers at once for a job of three slots: three distinct slots (one winner per slot's
  create), one refused in one line; a restarted slot waits for its dead incarnation's lease."""
  url = cluster.url("claims")
  results, errors = [None] * 4, [None] * 4
  def claim(i):
    try:
      results[i] = etcd_kv.connect(url, capacity=3, slot=None, lease_s=3)
    except etcd_kv.SlotError as e:
      errors[i] = str(e)
  threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
  [t.start() for t in threads]
  [t.join(timeout=120) for t in threads]
  won = [r for r in results if r is not None]
  assert sorted(r.slot for r in won) == [0, 1, 2], (results, errors)
  refused = [e for e in errors if e is not None]
  assert len(refused) == 1 and refused[0].startswith("config.num_replicas=3 is not valid for one more process")
  # Nobody was alive before them: a fresh job, nobody rejoins. Slot 1 crashes; its restart takes the slot
  # once the old lease ran out, and rejoins (the slot was used before, others are alive).
  for r in won:
    r.kv.set(f"live/{r.slot}", f"{r.incarnation}:1")
  assert not any(r.rejoining for r in won if r.slot == 0)
  dead = next(r for r in won if r.slot == 1)
  dead.kv._stop.set()  # pylint: disable=protected-access
  again = etcd_kv.connect(url, capacity=3, slot=1, lease_s=3)
  assert again.slot == 1 and again.rejoining and again.incarnation != dead.incarnation
  # A slot held by a live process is refused, naming it, after waiting one lease for it to run out.
  with pytest.raises(etcd_kv.SlotError, match=r"^--process_id=0 is not valid: slot 0 of the job .* is held by a live"):
    etcd_kv.connect(url, capacity=3, slot=0, lease_s=3)
  for r in won + [again]:
    r.close()


@pytest.mark.real
def test_the_store_serves_on_through_the_loss_of_its_leader(cluster):
  """The client talks to the leader when it dies: an election and a failover to another member."""
  leader = cluster.leader()
  kv = _kv(cluster, first=leader)
  kv.set("before", "1")
  assert kv.increment("n", 1) == 1
  cluster.kill(leader)
  start = time.monotonic()
  assert kv.get("before") == "1"  # written before: kept by the others
  assert kv.increment("n", 1) == 2 and kv.create("after", "x")
  took = time.monotonic() - start
  assert took < kv.retry_s, took  # an election and a failover, well within the retry budget
  assert kv.wait("after", 1.0) == "x"
  kv.close()


@pytest.mark.real
def test_the_command_line_names_an_etcd_member_that_does_not_answer(tmp_path):
  """One line naming the endpoint, exit status 2, within a bounded time (JAX's start-up and 10 s)."""
  pytest.importorskip("etcd3gw")
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  sock.close()
  env = {k: v for k, v in launch_local.process_env(0, 1, 1, 1).items()
         if k not in ("NOLOCO_COORDINATOR_ADDRESS", "NOLOCO_NUM_PROCESSES", "NOLOCO_PROCESS_ID")}
  start = time.monotonic()
  done = subprocess.run([sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke",
                         f"--workdir={tmp_path}", "--config.outer.schedule=async", "--config.num_replicas=4",
                         f"--control=etcd://127.0.0.1:{port}/job"], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  took = time.monotonic() - start
  assert done.returncode == 2, done.stderr[-3000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith(f"noloco_jax: etcd: no member answered (lease grant) within 10 s: 127.0.0.1:{port}: "
                         "connection refused"), last
  assert took < 120, took


# ---- A job on etcd ----


def _jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _wait_for(predicate, timeout_s, what, logs):
  end = time.time() + timeout_s
  while time.time() < end:
    if predicate():
      return
    time.sleep(1.0)
  raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs()}")


@pytest.mark.real
def test_a_job_on_etcd_outlives_its_leader_and_grows_from_4_to_6_processes_and_back(cluster, tmp_path):
  root = str(tmp_path)
  workdir, log_dir = os.path.join(root, "run"), os.path.join(root, "logs")
  # Every process talks to the leader first: its death costs them an election and a failover.
  leader = cluster.leader()
  url = "etcd://" + ",".join(cluster.endpoints[leader:] + cluster.endpoints[:leader]) + "/grow"
  flags = ["--config=configs/default.py:smoke", f"--workdir={workdir}", "--config.outer.schedule=async",
           "--config.num_replicas=6", "--config.num_steps=100000", "--config.eval_every=0", "--config.log_every=3",
           "--config.outer.asynchronous.max_wait_s=2", "--config.outer.asynchronous.exchange_timeout_s=10", "--config.outer.asynchronous.lease_s=10"]
  extra = {"NOLOCO_CONTROL": url, "NOLOCO_FAULTS": "delay:seconds=0.1"}
  job = launch_local.Job(4, 1, flags, log_dir=log_dir, env=extra, cwd=ROOT)
  procs = list(job.procs)
  newcomers = []

  def logs():
    return "\n".join(f"--- {n}\n" + open(os.path.join(log_dir, n)).read()[-3000:] for n in sorted(os.listdir(log_dir)))

  def rounds(slot, since=0.0, status="exchanged"):
    return [p for p in _jsonl(os.path.join(workdir, f"process_{slot}", f"pairings_{slot}.jsonl"))
            if p["status"] == status and p["time"] > since]

  try:
    _wait_for(lambda: all(len(rounds(s)) >= 2 for s in range(4)), 600, "four processes to pair", logs)
    # The etcd leader dies; no process is restarted, and every one trains and pairs on.
    assert cluster.leader() == leader, "the leadership moved: the member killed would not be the one talked to"
    cluster.kill(leader)
    killed_at = time.time()
    _wait_for(lambda: all(len(rounds(s, killed_at)) >= 2 for s in range(4)), 300,
              "every process to pair again after the leader's death", logs)
    # Two processes that were never part of the job: no --process_id, no reserved slot.
    env = {k: v for k, v in launch_local.process_env(0, 1, 1, 1, extra).items()
           if k not in ("NOLOCO_COORDINATOR_ADDRESS", "NOLOCO_NUM_PROCESSES", "NOLOCO_PROCESS_ID")}
    grown_at = time.time()
    for i in range(2):
      with open(os.path.join(log_dir, f"newcomer_{i}.log"), "w") as log:
        newcomers.append(subprocess.Popen([sys.executable, "-m", "noloco_jax.main", *flags], env=env, cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT))
    _wait_for(lambda: all(len(rounds(s, grown_at)) >= 2 for s in (4, 5)), 600,
              "the newcomers to take slots 4 and 5 and pair", logs)
    for p in newcomers:  # SIGTERM: each saves and leaves
      p.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p in newcomers] == [0, 0], logs()
    # A round grouped before they left ends within max_wait_s + exchange_timeout_s (failed): then none has them.
    settled_at = time.time() + 2 + 10 + 1
    _wait_for(lambda: all(len(rounds(s, settled_at)) >= 2 for s in range(4)), 300,
              "the four to pair among themselves again", logs)
    for p in procs:
      p.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0], logs()
  finally:
    for p in procs + newcomers:
      if p.poll() is None:
        p.kill()

  everything = {s: _jsonl(os.path.join(workdir, f"process_{s}", f"pairings_{s}.jsonl")) for s in range(6)}
  # Nobody restarted: one incarnation per slot, through the leader's death; and nobody was ever held lost by
  # another (the election and failover took less than a lease; who left said so before its lease went).
  for s, rows in everything.items():
    assert len({r["incarnation"] for r in rows}) == 1, (s, {r["incarnation"] for r in rows})
  for s in range(6):
    events = _jsonl(os.path.join(workdir, f"process_{s}", f"membership_{s}.jsonl"))
    lost = [e for e in events if e.get("event") == "lost"]
    assert not lost, (s, lost)
  # The newcomers joined from a live peer (the donor logged the same digest) and paired with the four.
  for s in (4, 5):
    joined = [e for e in _jsonl(os.path.join(workdir, f"process_{s}", f"membership_{s}.jsonl"))
              if e.get("event") == "joined_from"]
    assert len(joined) == 1 and joined[0]["donor"] in set(range(6)) - {s}, joined  # the other newcomer may be it
    donor = joined[0]["donor"]
    served = [e for e in _jsonl(os.path.join(workdir, f"process_{donor}", f"membership_{donor}.jsonl"))
              if e.get("event") == "served_join" and e["joiner"] == s]
    assert [e["digest"] for e in served] == [joined[0]["digest"]]
  partners = {p for s in (4, 5) for r in rounds(s) for p in r["group"]} - {4, 5}
  assert partners, "the newcomers paired only with each other"
  # After they left, the four never grouped with them again (they said so as they left: no lease to wait for).
  after = [r for s in range(4) for r in everything[s] if r["time"] > settled_at]
  assert all(set(r["group"]) <= {0, 1, 2, 3} for r in after), [r for r in after if not set(r["group"]) <= {0, 1, 2, 3}]
  # Their slots were given back at once (leases revoked), the four's with them at the end.
  probe = _kv(cluster, job="grow")
  assert probe.dir(etcd_kv.SLOT) == {}
  probe.close()
