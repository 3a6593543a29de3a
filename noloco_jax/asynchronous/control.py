"""The control plane's store: JAX's coordination service, reached through one small wrapper.

Why this module exists: everything the asynchronous schedule needs to agree on (who is alive, who is
ready, who pairs with whom, where each transfer server listens) is a few hundred bytes, and JAX
already runs a service that every process of a `jax.distributed` job talks to: the coordination
service, whose key-value store is reachable from every process and linearised by the one process
that serves it. Its client is private (`jax._src.distributed.global_state.client`, or one made by
`jax._src.lib._jax.get_distributed_runtime_client`); this module is the ONLY place that touches it
(and the only place that starts the service by hand, see `serve`), so that a move of the private API
is a one-file fix.

What the store offers (measured with jax 0.10.2, docs/async.md):

- `set` (overwrite) and `create` (insert only if absent: the service answers ALREADY_EXISTS to a
  second insert of one key, so exactly one of several racing creators wins: a test-and-set);
- `increment` (atomic add on an integer key; `increment(key, 0)` reads it): a ticket counter;
- `get` (None when absent), `wait` (blocks up to a timeout), `dir` (every key under a prefix), `delete`.

The tests implement the same interface in one process (tests/memory_kv.py: a dict and a lock): the
matchmaker and the liveness tracker run unchanged on it in thread-level tests.

Two ways to join the service (both JAX's own client and service classes):

- `connect` (the trainer's asynchronous schedule, experiments/async_demo.py): the control plane only.
  The client is not handed to JAX's backends, so the process's JAX sees only its own devices
  (jax.process_count() == 1) and no program, collective or barrier can involve another process. The
  service is started recoverable: when a client dies the others keep running (without it, the
  service tells every process to terminate: "shared fate").
- `initialize`: `jax.distributed.initialize` with `jax_enable_recoverability` set first (it must be
  set before), for benchmarks that also run programs over several processes' devices
  (experiments/bench_async.py compares such a program with the transfer server).

Process 0. The service runs inside process 0 (slot 0) by default; when that process exits, every other
process aborts (status 134), recoverability or not: a limit of JAX's runtime. `serve` runs the same
service in a small process of its own: `python -m noloco_jax.asynchronous.control --port=PORT
--num_processes=P`. The training processes then connect to it (`standalone_service=True`); process 0
can then die like any other. A spare slot for a process that joins later is reserved at start-up with
`--reserve_slot=ID` (the service cannot start with a client missing, nor grow).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from typing import Protocol

import jax

NAMESPACE = "noloco_async/"  # every key of the asynchronous schedule lives under this prefix


class KV(Protocol):
  """The key-value operations the control plane uses (JaxKV over the service; MemoryKV in tests)."""

  def set(self, key: str, value: str) -> None: ...
  def create(self, key: str, value: str) -> bool: ...
  def get(self, key: str) -> str | None: ...
  def wait(self, key: str, timeout_s: float) -> str | None: ...
  def increment(self, key: str, by: int) -> int: ...
  def dir(self, prefix: str) -> dict[str, str]: ...
  def delete(self, key: str) -> None: ...


# ---- Over JAX's coordination service ----


def _is(error: Exception, code: str) -> bool:
  """Whether a JaxRuntimeError carries the status `code` (its message starts with it)."""
  return str(error).startswith(code)


class JaxKV:
  """The coordination service's key-value store, with every key under NAMESPACE."""

  def __init__(self, client=None):
    if client is None:
      from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top  (private: here only)
      client = global_state.client
      if client is None:
        raise RuntimeError("jax.distributed is not initialised: call noloco_jax.asynchronous.control.initialize "
                           "(or jax.distributed.initialize) first.")
    self._client = client

  def set(self, key: str, value: str) -> None:
    self._client.key_value_set(NAMESPACE + key, value, allow_overwrite=True)

  def create(self, key: str, value: str) -> bool:
    """Inserts `key` unless it exists; True if this call inserted it (exactly one racing caller wins)."""
    try:
      self._client.key_value_set(NAMESPACE + key, value, allow_overwrite=False)
      return True
    except jax.errors.JaxRuntimeError as e:
      if _is(e, "ALREADY_EXISTS"):
        return False
      raise

  def get(self, key: str) -> str | None:
    try:
      return self._client.key_value_try_get(NAMESPACE + key)
    except jax.errors.JaxRuntimeError as e:
      if _is(e, "NOT_FOUND"):
        return None
      raise

  def wait(self, key: str, timeout_s: float) -> str | None:
    """The value of `key` once it exists, or None after `timeout_s` (the service holds the call)."""
    if timeout_s <= 0:
      return self.get(key)
    try:
      return self._client.blocking_key_value_get(NAMESPACE + key, max(1, int(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as e:
      if _is(e, "DEADLINE_EXCEEDED") or "timed out" in str(e).lower():
        return None
      raise

  def increment(self, key: str, by: int) -> int:
    return int(self._client.key_value_increment(NAMESPACE + key, by))

  def dir(self, prefix: str) -> dict[str, str]:
    """{key: value} of every key under `prefix` (keys without NAMESPACE; `prefix` must end with '/')."""
    full = NAMESPACE + prefix
    return {k[len(NAMESPACE):]: v for k, v in self._client.key_value_dir_get(full)}

  def delete(self, key: str) -> None:
    self._client.key_value_delete(NAMESPACE + key)

  # Bytes values: the store as a data plane, measured by experiments/bench_async.py (every
  # byte passes through the one process serving the store; not used for weights, docs/async.md).

  def set_bytes(self, key: str, value: bytes) -> None:
    self._client.key_value_set_bytes(NAMESPACE + key, value, allow_overwrite=True)

  def wait_bytes(self, key: str, timeout_s: float) -> bytes | None:
    try:
      return self._client.blocking_key_value_get_bytes(NAMESPACE + key, max(1, int(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as e:
      if _is(e, "DEADLINE_EXCEEDED") or "timed out" in str(e).lower():
        return None
      raise


def live_nodes(process_ids) -> dict[int, int]:
  """The runtime's own view: {process id: incarnation} of the live processes among `process_ids`.

  A BARRIER (what `jax.live_devices` calls): it returns once every live process named has called it,
  and a dead one is left out only once the service has declared it dead (heartbeat_timeout_s). Not
  used by the schedule, which cannot wait for the others (liveness.py); measured in docs/async.md §9.
  """
  from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top
  return {int(k): int(v) for k, v in global_state.client.get_live_nodes(list(process_ids)).items()}


def incarnation(client=None, slot: int | None = None) -> int:
  """This process's incarnation id as the coordination service knows it (new on every (re)start).

  `get_live_nodes` over this process alone returns at once (over several processes it is a barrier).
  Without arguments: the client and process id of `jax.distributed` (`initialize`).
  """
  if client is None:
    me = jax.process_index()
    return live_nodes([me])[me]
  return int(client.get_live_nodes([slot])[slot])


# ---- Starting the runtime ----


def enable_recoverability() -> None:
  """Lets the job outlive a failed process (must precede jax.distributed.initialize)."""
  if jax.distributed.is_initialized() and not jax.config.jax_enable_recoverability:
    raise RuntimeError("jax.distributed was initialised without jax_enable_recoverability: the asynchronous "
                       "schedule needs it set before jax.distributed.initialize (the default ends every process "
                       "when one dies).")
  jax.config.update("jax_enable_recoverability", True)


def _spare_port(host: str) -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def initialize(coordinator_address: str, num_processes: int, process_id: int, *, heartbeat_timeout_s: int = 30,
               initialization_timeout_s: int = 300, shutdown_timeout_s: int = 30,
               standalone_service: bool = False) -> JaxKV:
  """jax.distributed with recoverability on; returns the store.

  `standalone_service`: the service at `coordinator_address` runs in its own process (`serve`), so
  process 0 binds the in-process service JAX always starts for it to a spare local port, where no
  one connects, and is then a process like the others.
  """
  enable_recoverability()
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives between processes
  bind = None
  if standalone_service and process_id == 0:
    bind = f"127.0.0.1:{_spare_port('127.0.0.1')}"
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s, coordinator_bind_address=bind)
  return JaxKV()


@dataclasses.dataclass
class Connection:
  """This process's place in the control plane (`connect`, or etcd_kv.connect): its slot, its store, the
  service it may host, and whether it rejoins a running job (its slot was used before in this job)."""
  kv: KV
  slot: int
  num_slots: int
  incarnation: int
  client: object  # JAX's DistributedRuntimeClient (kept alive: its heartbeats are our membership in the service)
  service: object | None  # the coordination service, when this process hosts it (slot 0, not standalone)
  rejoining: bool = False  # take the weights from a live peer before training (asynchronous/job.py)

  @property
  def hosts_service(self) -> bool:
    return self.service is not None

  def close(self) -> None:
    """Leaves the control plane. On etcd: revokes this process's lease, so its keys (heartbeat, slot) go at
    once. On JAX's service: nothing (main.py leaves with os._exit, skipping the client's goodbye)."""
    close = getattr(self.kv, "close", None)
    if close is not None:
      close()


def connect(coordinator_address: str, num_slots: int, slot: int, *, heartbeat_timeout_s: int = 30,
            initialization_timeout_s: int = 300, standalone_service: bool = False) -> Connection:
  """Joins the control plane of an asynchronous job WITHOUT making JAX's compute runtime multi-process.

  The same service and client as `jax.distributed.initialize` (JAX's own classes, the service
  recoverable), but the client is not handed to JAX's backends: this process's JAX sees only its own
  devices (jax.process_count() == 1). So no program, collective or barrier of the trainer (an
  evaluation, orbax's saves, the start-up checks) can ever involve another process: the schedule's
  only links between processes are the store and the transfer servers (docs/async.md §1). Slot 0
  starts the service in-process unless it runs in a process of its own (`standalone_service`, `main`).

  Like `jax.distributed`, the service takes `num_slots` clients and waits at start-up until all have
  connected (`initialization_timeout_s`); a client that restarts reconnects with its slot and gets a
  new incarnation (measured: accepted before or after the service noticed the old one's death).
  """
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top  (private: here only)
  if not 0 <= slot < num_slots:
    raise ValueError(f"process id {slot} is not valid: an integer in [0, {num_slots - 1}] (num_processes={num_slots}).")
  service = None
  if slot == 0 and not standalone_service:
    port = int(coordinator_address.rsplit(":", 1)[1])
    service = serve(port, num_slots, heartbeat_timeout_s=heartbeat_timeout_s)
  client = _jax.get_distributed_runtime_client(coordinator_address, slot, init_timeout=initialization_timeout_s,
                                               heartbeat_timeout=heartbeat_timeout_s, use_compression=True)
  client.connect()
  return Connection(JaxKV(client), slot, num_slots, incarnation(client, slot), client, service)


def serve(port: int, num_processes: int, *, heartbeat_timeout_s: int = 30, shutdown_timeout_s: int = 30,
          bind_host: str = "[::]"):
  """Starts JAX's coordination service (recoverable) in this process; returns its handle (keep it alive)."""
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top  (private: here only)
  return _jax.get_distributed_runtime_service(f"{bind_host}:{port}", num_processes,
                                              heartbeat_timeout=heartbeat_timeout_s,
                                              shutdown_timeout=shutdown_timeout_s, recoverable=True)


def reserve_slot(coordinator_address: str, num_processes: int, process_id: int, *, heartbeat_timeout_s: int = 30,
                 standalone_service: bool = False) -> None:
  """Takes part in the job's start-up as `process_id`, then leaves: a spare slot for a process that joins later.

  The coordination service cannot start with fewer clients than `num_processes` (every client registers
  at start-up; measured: with one missing, the others abort after initialization_timeout_s), and
  cannot grow past it. So a job meant to grow starts its spare slots with this; a process that
  joins later connects with the same id (its new incarnation is accepted, recoverability on).
  """
  connection = connect(coordinator_address, num_processes, process_id, heartbeat_timeout_s=heartbeat_timeout_s,
                       standalone_service=standalone_service)
  # liveness.py's "left": never a member; and, as an earlier incarnation of the slot, it makes the process
  # that takes the slot later join from a live peer (asynchronous/job.py).
  connection.kv.set(f"live/{process_id}", f"{connection.incarnation}:left")
  logging.info("Slot %d reserved for a process that joins later.", process_id)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="Runs the coordination service of an asynchronous job in a "
                                   "process of its own, until SIGTERM or SIGINT; or, with --reserve_slot, "
                                   "takes part in a job's start-up as that process id and leaves at once.")
  parser.add_argument("--port", type=int, default=None, help="serve on this port")
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--heartbeat_timeout_s", type=int, default=30)
  parser.add_argument("--shutdown_timeout_s", type=int, default=30)
  parser.add_argument("--reserve_slot", type=int, default=None, help="this process id is a spare slot")
  parser.add_argument("--coordinator_address", default=None, help="host:port of the service (--reserve_slot)")
  parser.add_argument("--standalone_service", action="store_true", help="the service runs in its own process")
  opts = parser.parse_args(argv)
  if opts.num_processes < 1:
    parser.error(f"--num_processes={opts.num_processes} is not valid: an integer ≥ 1.")
  if opts.reserve_slot is not None:
    if not opts.coordinator_address:
      parser.error("--reserve_slot needs --coordinator_address=host:port.")
    reserve_slot(opts.coordinator_address, opts.num_processes, opts.reserve_slot,
                 heartbeat_timeout_s=opts.heartbeat_timeout_s, standalone_service=opts.standalone_service)
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access  (JAX's shutdown barrier would wait for the whole job)
  if opts.port is None:
    parser.error("--port is needed to serve (or --reserve_slot to reserve a slot).")
  service = serve(opts.port, opts.num_processes, heartbeat_timeout_s=opts.heartbeat_timeout_s,
                  shutdown_timeout_s=opts.shutdown_timeout_s)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  print(f"coordination service for {opts.num_processes} processes on port {opts.port}", flush=True)
  stop.wait()
  service.shutdown()
  return 0


if __name__ == "__main__":
  logging.basicConfig(level=logging.INFO)
  sys.exit(main())
