"""One process of an asynchronous job (`outer.schedule='async'`): its slot, its own run, its start-up.

Why every process is a JAX program of its own. In the lock-step schedule the P processes form one
`jax.distributed` job: one mesh over all devices, and every evaluation, checkpoint and start-up check
is a program or barrier that all processes run together. A process that trains at its own pace can
take part in none of those. So here each process connects to the job's coordination service for the
control plane only (`control.connect`: JAX's own service and client, recoverable) and otherwise runs
the ordinary single-process trainer on its own devices, in its own workdir, with its own replica:

    WORKDIR/process_<slot>/         its run: checkpoints/, metrics.jsonl, config.json, run.lock, ...
                    pairings_<slot>.jsonl, membership_<slot>.jsonl   (asynchronous/session.py)

A process saves, restores, evaluates and logs exactly as a one-process run does, with no barrier
across processes (none exists); whoever reads the job merges the per-process files
(asynchronous/logs.py). The only links between processes are the store and the transfer servers.

The layout is one replica per process: replica `slot` of the job's `num_replicas` (= processes), which
decides the replica's share of the data (io/data: replica `slot` of N, as in lock-step).

A process that starts while its slot has been used before in this service's lifetime (it was
restarted, or its slot was reserved at start-up: control.reserve_slot) is *rejoining*: its round
driver takes its weights from a live peer before training (training/rounds/asynchronous.py).

The control plane (`start`'s `control_plane`, main.py's --control): JAX's coordination service
(`'jax'`, the default: in process 0 or standalone; it holds the `num_processes` slots it started with),
or an etcd cluster (`'etcd://HOST:PORT,...[/JOB]'`, asynchronous/etcd_kv.py: replicated, so it survives
the loss of any one member, and it admits processes that were never part of the job). On etcd,
`config.num_replicas` is the most processes the job holds at once (one data shard per slot); a process
started without a process id takes the highest free slot and, when a peer is alive, joins from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from noloco_jax import config as config_lib
from noloco_jax.asynchronous import control, etcd_kv, liveness
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.runtime import failures, job_checks

CONFIG_KEY = "config/"  # config/<slot>: the config each process started with (compared at start-up)
DONE = "done/"  # done/<slot> = incarnation: that process is exiting (Process.finish)
JAX = "jax"  # the control plane of JAX's coordination service (else an etcd URL: etcd_kv.py)
CONFIG_WAIT_S = 30.0  # at start-up, how long a process of JAX's service waits for the others to post their configs


class ConfigMismatch(failures.ReportedError, RuntimeError):
  """This process's config differs from another process's of the same job."""


@dataclasses.dataclass
class Process:
  """What a process of an asynchronous job knows about its place in it (`start`)."""
  connection: control.Connection
  heartbeat: liveness.Liveness  # its lease, beating from connect on (a process starting up is alive)
  num_replicas: int  # the job's: one per slot
  rejoining: bool  # its slot was used before in this job: take the weights from a live peer
  # The service's heartbeat timeout (--heartbeat_timeout_s): how long it counts a silent client as connected.
  service_timeout_s: float = 0.0

  @property
  def kv(self) -> control.KV:
    return self.connection.kv

  @property
  def slot(self) -> int:
    return self.connection.slot

  @property
  def incarnation(self) -> int:
    return self.connection.incarnation

  @property
  def replica_ids(self) -> tuple[int, ...]:
    """The job's replicas this process holds (their data shards): its own."""
    return (self.slot,)

  def say_done(self) -> bool:
    """Says this process is exiting (`done/<slot>`), so that the service's host need not wait for it;
    False when the service is gone (nobody is left to tell)."""
    try:
      self.connection.kv.set(f"{DONE}{self.slot}", str(self.incarnation))
      return True
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Process %d could not say it is done: %s", self.slot, str(e).splitlines()[0])
      return False

  def finish(self, *, lease_s: float, poll_s: float = 0.5, grace_s: float = 1.0) -> None:
    """At the very end of this process (main.py exits right after). It says so (`done/<slot>`). The
    process hosting the coordination service first waits until every other process has said so or has
    died: when it exits, the service goes, and every process still connected aborts (a limit of JAX's
    runtime, docs/async.md §5). A process that left the rounds keeps beating while it saves
    (liveness.Liveness.leave(keep_beating=True)), so it is waited for. A silent process is held dead only
    once the service itself would hold it dead (`service_timeout_s`, if longer than `lease_s`): until then
    it may be stopped (SIGSTOP, a swapped-out host) rather than dead, and it would resume, begin its save,
    and be aborted by this exit with its save half written."""
    if not self.say_done():
      return
    kv = self.connection.kv
    if not self.connection.hosts_service:
      if isinstance(kv, etcd_kv.EtcdKV):
        # Revoking the lease deletes the heartbeat key at once: a peer that had not yet read "left" in it
        # would hold this process lost a lease later. Two more beats first, then the slot is free at once.
        time.sleep(2 * self.heartbeat.beat_s)
      self.connection.close()
      return
    silent_s = max(lease_s, self.service_timeout_s)
    self.heartbeat.leave(keep_beating=True)
    last: dict[int, tuple[str, float]] = {}  # slot -> (lease value, when it last changed, by our clock)
    waiting_for = None
    while True:
      now, done = time.monotonic(), kv.dir(DONE)
      running = []
      for key, value in sorted(kv.dir(liveness.PREFIX).items()):
        slot = int(key[len(liveness.PREFIX):])
        if slot == self.slot:
          continue
        inc, _, tail = value.partition(":")
        if last.get(slot, ("", 0.0))[0] != value:
          last[slot] = (value, now)
        dead = tail == liveness.LEFT or now - last[slot][1] > silent_s  # ("left" without beating: a reserved slot)
        if not dead and done.get(f"{DONE}{slot}") != inc:
          running.append(slot)
      if not running:
        time.sleep(grace_s)  # the last ones to say "done" are exiting now
        return
      if running != waiting_for:
        waiting_for = running
        logging.info("Process %d hosts the coordination service: it waits for processes %s to finish (its exit "
                     "would end them; one that is silent, up to %.0f s: it may be stopped, not dead).", self.slot,
                     running, silent_s)
      time.sleep(poll_s)


def process_workdir(job_workdir: str, slot: int) -> str:
  """WORKDIR/process_<slot>: where process `slot` of an asynchronous job trains, saves and logs."""
  return os.path.join(job_workdir, f"process_{slot}")


def session_options(outer, seed: int) -> session_lib.Options:
  """The engine's options from config.outer (`outer`: its asynchronous section, a heartbeat about ten times
  per lease; the fragments of streaming) and config.seed."""
  o = outer.asynchronous
  return session_lib.Options(seed=seed, window_s=o.match_window_s, max_wait_s=o.max_wait_s,
                             exchange_timeout_s=o.exchange_timeout_s, odd=o.match_odd,
                             beat_s=min(0.5, o.lease_s / 10), lease_s=o.lease_s, join_timeout_s=o.join_timeout_s,
                             partner_silence_s=o.partner_silence_s, fragments=outer.streaming.fragments)


def check_layout(config: config_lib.Config, num_processes: int | None, *, process_id: int | None = None,
                 control_plane: str = JAX) -> None:
  """One line naming the field when the job's process count does not fit the config (ConfigError)."""
  n = config.num_replicas
  if control_plane != JAX:
    # On etcd a job holds at most num_replicas processes (one data shard per slot), and may start with fewer.
    if n < 2:
      config_lib.fields.fail("num_replicas", n, "≥ 2 with outer.schedule='async' on etcd (the most processes the "
                             "job holds at once, one data shard each)")
    if num_processes is not None and num_processes > n:
      config_lib.fields.fail("num_replicas", n, f"≥ {num_processes}, the processes the job starts with (on etcd, "
                             "num_replicas is the most processes the job holds at once: one data shard per slot)")
    if process_id is not None and not 0 <= process_id < n:
      raise config_lib.ConfigError(f"--process_id={process_id} is not valid: a slot in [0, {n - 1}] "
                                   f"(config.num_replicas={n}, the most processes the job holds), or none: a process "
                                   "started without one takes a free slot.")
    return
  if num_processes is None or num_processes < 2:
    config_lib.fields.fail("outer.schedule", "async", "'lockstep' in a job of one process (the asynchronous "
                           "schedule pairs processes: start several, e.g. python -m noloco_jax.runtime.launch_local "
                           "--num_processes=4 --devices_per_process=1 -- ...)")
  if n != num_processes:
    grow = (" (JAX's coordination service cannot grow past the processes it starts with: to let the job grow, run "
            "it on etcd, --control=etcd://HOST:PORT,...)") if n > num_processes else ""
    config_lib.fields.fail("num_replicas", n, f"{num_processes}, the number of processes, with "
                           f"outer.schedule='async' (one replica per process){grow}")
  if process_id is not None and not 0 <= process_id < num_processes:
    raise config_lib.ConfigError(
        f"--process_id={process_id} is not valid with JAX's coordination service: a slot in [0, {num_processes - 1}]; "
        f"the service holds the {num_processes} processes it started with and cannot grow (reserve spare slots at "
        "start-up, python -m noloco_jax.asynchronous.control --reserve_slot=ID, or run the job on etcd: "
        "--control=etcd://HOST:PORT,...).")


def process_config(config: config_lib.Config) -> config_lib.Config:
  """The config a process runs: the job's, with its one replica on its own devices."""
  return dataclasses.replace(config, num_replicas=1, num_devices=0)


def start(config: config_lib.Config, coordinator_address: str | None, num_processes: int | None,
          process_id: int | None, *, heartbeat_timeout_s: int, initialization_timeout_s: int,
          standalone_service: bool = False, control_plane: str = JAX) -> Process:
  """Connects this process to the job's control plane and checks that it runs the job's config.

  `control_plane`: JAX's coordination service at `coordinator_address` ('jax'), or an etcd URL (then
  `num_processes` and `process_id` may be None: a newcomer takes a free slot). A control plane that
  cannot be used (no etcd member answers, the slot is held, the job is full) is a ConfigError: one line.
  Raises ConfigMismatch (one line) when the config differs from another process's: by then this process
  has said it is done and, if it hosts the service, the others have left, so that the caller can exit
  without ending anybody.
  """
  check_layout(config, num_processes, process_id=process_id, control_plane=control_plane)
  options = session_options(config.outer, config.seed)
  if control_plane == JAX:
    connection = _connect_jax(coordinator_address, num_processes, process_id, heartbeat_timeout_s,
                              initialization_timeout_s, standalone_service)
    where = "in this process" if connection.hosts_service else f"at {coordinator_address}"
  else:
    try:
      connection = etcd_kv.connect(control_plane, capacity=config.num_replicas, slot=process_id,
                                   lease_s=options.lease_s)
    except (ImportError, ValueError, etcd_kv.Unavailable, etcd_kv.SlotError) as e:
      raise config_lib.ConfigError(str(e)) from None
    where = f"on etcd ({control_plane})"
  kv, slot = connection.kv, connection.slot
  # The lease starts now, not when training starts: a process still starting up (a minute on a loaded
  # machine) is alive, and the process hosting the service waits for it before it leaves.
  heartbeat = liveness.Liveness(kv, slot, connection.incarnation, beat_s=options.beat_s,
                                lease_s=options.lease_s, observe=True).start()
  process = Process(connection, heartbeat, config.num_replicas, connection.rejoining,
                    service_timeout_s=heartbeat_timeout_s)
  try:
    # JAX's service starts only once every slot has connected: each process waits for all the configs.
    # An etcd job may start with fewer processes than slots, and admits newcomers: the posted ones are compared.
    _check_same_config(kv, slot, connection.num_slots, config, wait_s=CONFIG_WAIT_S if control_plane == JAX else 0.0)
  except ConfigMismatch:
    process.finish(lease_s=options.lease_s)  # the process hosting the service waits: its exit would end the others
    raise
  logging.info("Asynchronous job: process %d of %d (incarnation %d), %s; control plane %s.", slot,
               connection.num_slots, connection.incarnation,
               "rejoining a running job" if connection.rejoining else "starting", where)
  return process


def _connect_jax(coordinator_address, num_processes, process_id, heartbeat_timeout_s, initialization_timeout_s,
                        standalone_service) -> control.Connection:
  """JAX's coordination service: whoever used this slot before (an earlier incarnation's heartbeat, or
  control.reserve_slot's "left") left its lease key, so this process rejoins a running job."""
  connection = control.connect(coordinator_address, num_processes, process_id, heartbeat_timeout_s=heartbeat_timeout_s,
                               initialization_timeout_s=initialization_timeout_s, standalone_service=standalone_service)
  connection.rejoining = connection.kv.get(f"{liveness.PREFIX}{process_id}") is not None
  return connection


def _check_same_config(kv: control.KV, slot: int, num_slots: int, config: config_lib.Config,
                       wait_s: float = CONFIG_WAIT_S) -> None:
  """Posts this process's config, waits until every slot has posted its own (or is a reserved one, which
  trains nothing), and compares them all (runtime/job_checks, as a lock-step job's start-up check compares
  them): so every process of a job started with different configs refuses, each saying which fields differ
  on which processes. On JAX's service the processes have all connected by now (it starts only with every
  slot), so the wait is for the few milliseconds between a peer's connecting and its posting; after
  `wait_s` the configs posted so far are compared."""
  mine = job_checks.flatten_config(config)
  kv.set(f"{CONFIG_KEY}{slot}", json.dumps(mine, sort_keys=True))
  deadline = time.monotonic() + wait_s
  while True:
    posted = {int(k[len(CONFIG_KEY):]): json.loads(v) for k, v in kv.dir(CONFIG_KEY).items()}
    reserved = {int(k[len(liveness.PREFIX):]) for k, v in kv.dir(liveness.PREFIX).items()
                if liveness.is_left(v.partition(":")[2]) and int(k[len(liveness.PREFIX):]) not in posted}
    if set(posted) | reserved >= set(range(num_slots)) or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  others = sorted(s for s, flat in posted.items() if s != slot and flat != mine)
  if others:
    order = sorted(posted)
    differ = job_checks.config_differences([posted[s] for s in order], processes=order)
    raise ConfigMismatch(
        f"process {slot} of this asynchronous job runs another config than "
        f"{f'process {others[0]}' if len(others) == 1 else f'processes {others}'}: "
        f"{' | '.join(differ[:6])}{f' (and {len(differ) - 6} more fields)' if len(differ) > 6 else ''}. "
        "Start every process with the same config and overrides.")
