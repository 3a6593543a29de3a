"""Multi-process jobs: starting `jax.distributed`, failing fast, and the start-up consistency check.

One process per host (TPU pods, CPU hosts) or per GPU (SLURM, Open MPI) forms one job. Where the
values come from, first match wins:

  1. flags of noloco_jax.main: --coordinator_address, --num_processes, --process_id;
  2. environment: NOLOCO_COORDINATOR_ADDRESS, NOLOCO_NUM_PROCESSES, NOLOCO_PROCESS_ID
     (what launch_local.py sets for each process it starts);
  3. the cluster, detected by JAX itself (SLURM, Open MPI, Cloud TPU VMs, Kubernetes): then
     `jax.distributed.initialize()` is called with no address, count or id and fills them in.

--distributed (NOLOCO_DISTRIBUTED) = auto | on | off: `auto` initialises when 1–3 name more than one
process; `on` always initialises (e.g. a TPU pod whose worker count JAX reads from the metadata
server); `off` never does. Timeouts (seconds): --heartbeat_timeout_s (NOLOCO_HEARTBEAT_TIMEOUT_S),
--initialization_timeout_s (NOLOCO_INITIALIZATION_TIMEOUT_S), --shutdown_timeout_s
(NOLOCO_SHUTDOWN_TIMEOUT_S).

Failure behaviour: when a process dies, peer_watch.py ends its peers within about a second (exit
code 1, one `Process i of P failed` line); a collective that fails first ends them through
`fail_fast`, with the same line. A host that vanishes without closing its connections is ended by the
distributed runtime once it has missed heartbeats for heartbeat_timeout_s. A job therefore never
hangs on a dead process for longer than about heartbeat_timeout_s.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.config import cli
from noloco_jax.runtime import job_checks
from noloco_jax.runtime import peer_watch
from noloco_jax.runtime import failures
from noloco_jax.runtime.options import ENV, Options
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib

PEER_WATCH_GRACE_S = 5.0  # after a failed collective, how long the peer watch may take to name a dead peer


class ConsistencyError(failures.ReportedError, RuntimeError):
  """The processes of one job disagree (config, seed, layout), or replicas start from different states."""


def process_coordinates(options: Options) -> tuple[str, int, int]:
  """(coordinator address, process count, process id) of a job whose processes do not form one
  jax.distributed job (the asynchronous schedule): from flags and environment, else from the cluster
  as JAX detects it (SLURM, Open MPI, TPU); one line and exit status 2 when they cannot be found."""
  address, count, pid = options.coordinator_address, options.num_processes, options.process_id
  if None in (address, count, pid) and detect_cluster() is not None:
    try:
      from jax._src import clusters  # pylint: disable=g-import-not-at-top  (what jax.distributed uses)
      address, count, pid, local_ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
          address, count, pid, None, None, options.initialization_timeout_s)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("cluster auto-detection failed: %s", e)
    else:
      _see_only_local_devices(local_ids)
  if None in (address, count, pid):
    cli.exit_usage(f"config.outer.schedule='async' needs the job's --coordinator_address, --num_processes and "
                   f"--process_id ({ENV['coordinator_address']}, {ENV['num_processes']}, {ENV['process_id']}), or a "
                   f"cluster JAX can detect (SLURM, Open MPI, TPU); got {address}, {count}, {pid} (JAX's coordination "
                   "service holds fixed slots: a process that joins a running job without one needs an etcd control "
                   "plane, --control=etcd://HOST:PORT,...).")
  return address, int(count), int(pid)


def _see_only_local_devices(local_ids) -> None:
  """Each process uses the GPU of its local index (SLURM_LOCALID), as jax.distributed.initialize does with
  the same ids. Without it, the processes of an asynchronous job sharing a node (tasks that see every GPU
  of it: scripts/slurm_gpu.sbatch's --gpus-per-node) would each start JAX on all of that node's GPUs."""
  if not local_ids:
    return
  visible = ",".join(str(i) for i in local_ids)
  jax.config.update("jax_cuda_visible_devices", visible)
  jax.config.update("jax_rocm_visible_devices", visible)
  logging.info("This process uses only the accelerator(s) %s of its node (its local index in the job).", visible)


def detect_cluster() -> tuple[str, int] | None:
  """(name, process count) of the cluster JAX's auto-detection would use here, or None.

  Uses the same registry as jax.distributed.initialize() (a private module: if it moves, detection
  is off and --distributed=on or explicit values still work).
  """
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
      if not env.opt_in_only_method and env.is_env_present():
        return env.__name__, int(env.get_process_count())
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("cluster auto-detection failed (%s); pass --distributed=on or explicit values.", e)
  return None


def plan(options: Options) -> tuple[bool, str]:
  """(whether to initialise jax.distributed, why), without touching JAX's backends."""
  if options.mode == "off":
    return False, "--distributed=off"
  if options.num_processes is not None:
    if options.num_processes < 1:
      raise ValueError(f"num_processes={options.num_processes} is not valid: an integer ≥ 1.")
    if options.num_processes > 1 or options.mode == "on":
      return True, f"num_processes={options.num_processes} given"
    return False, "num_processes=1 given"
  cluster = detect_cluster()
  if cluster is not None and (cluster[1] > 1 or options.mode == "on"):
    return True, f"{cluster[0]} detected with {cluster[1]} processes"
  if options.mode == "on":
    return True, "--distributed=on"
  return False, "no multi-process job detected"


def initialize(options: Options) -> bool:
  """Initialises jax.distributed when the job has several processes; returns whether it is running.

  Must run before anything touches JAX's backends (jax.devices(), any computation); when it returns
  True the backends have started, so per-process device counts can no longer change. Calling it again,
  or after something else initialised jax.distributed, does nothing (and returns True).
  """
  if jax.distributed.is_initialized():
    logging.info("jax.distributed is already initialised (process %d of %d); not initialising again.",
                 jax.process_index(), jax.process_count())
    return True
  try:
    start, why = plan(options)
  except ValueError as e:
    cli.exit_usage(str(e))
  if not start:
    logging.info("Single-process job (%s).", why)
    return False
  address, count, pid = options.coordinator_address, options.num_processes, options.process_id
  if count is not None and (address is None or pid is None) and detect_cluster() is None:
    cli.exit_usage(f"num_processes={count} also needs --coordinator_address ({ENV['coordinator_address']}) and "
                   f"--process_id ({ENV['process_id']}) outside a cluster JAX can detect (SLURM, Open MPI, TPU).")
  if address is not None and pid not in (None, 0):
    # Else the runtime aborts the process with a C++ stack dump when the coordinator never answers.
    wait_for_coordinator(address, options.initialization_timeout_s)
  # CPU collectives between processes need an implementation: gloo (TCP) ships with jaxlib. It only
  # concerns the CPU backend, so it is also harmless for GPU and TPU jobs. Must precede backend start.
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  logging.info("Initialising jax.distributed (%s): coordinator=%s, processes=%s, process id=%s.", why,
               address or "auto", count or "auto", "auto" if pid is None else pid)
  jax.distributed.initialize(
      coordinator_address=address, num_processes=count, process_id=pid,
      initialization_timeout=options.initialization_timeout_s,
      heartbeat_timeout_seconds=options.heartbeat_timeout_s,
      shutdown_timeout_seconds=options.shutdown_timeout_s)
  logging.info("Process %d of %d: %d local devices %s of %d in the job.", jax.process_index(),
               jax.process_count(), jax.local_device_count(), [d.id for d in jax.local_devices()],
               jax.device_count())
  return True


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Waits until process 0's coordinator accepts a TCP connection; after `timeout_s`, exits with one line."""
  host, _, port = address.rpartition(":")
  deadline, error = time.monotonic() + timeout_s, None
  while time.monotonic() < deadline:
    try:
      socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)).close()
      return
    except (OSError, ValueError) as e:
      error = e
      time.sleep(0.5)
  raise SystemExit(f"noloco_jax: error: the coordinator {address} (process 0) did not answer within {timeout_s} s "
                   f"({failures.first_line(error) if error else 'no attempt'}): start process 0, or check the "
                   f"address ({ENV['coordinator_address']}) and that its port is reachable from this host.")


@contextlib.contextmanager
def fail_fast():
  """In a multi-process job, turns any exception into a logged error and an immediate exit.

  Why not let it propagate: at exit, JAX waits at a shutdown barrier for every other process (up to
  shutdown_timeout_s), which a crashed peer never reaches. Exiting at once lets the peers' own
  collectives fail (the link closes) or their heartbeat checks end them, so the whole job stops within
  about heartbeat_timeout_s. Checkpoints stay valid: orbax commits a step atomically, so an interrupted
  save is never taken for a finished one. Single-process jobs re-raise as usual.
  """
  try:
    yield
  except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-except
    if not (jax.distributed.is_initialized() and jax.process_count() > 1):
      raise
    hint = ""
    if isinstance(e, jax.errors.JaxRuntimeError):
      # A dead peer breaks the collective and the peer watch's connection at once; the watch's line
      # names the dead process, so it is given the moment its thread needs (on a loaded machine, seconds).
      if peer_watch.peer_lost(PEER_WATCH_GRACE_S):
        time.sleep(PEER_WATCH_GRACE_S)  # the watch thread ends the process meanwhile
      hint = (" A collective failed: another process of the job has most likely died or been killed; "
              "its log shows why.")
    _, status, helps = failures.report(e, failures.run_workdir())
    # The traceback only where it helps (not for an error that names its cause, nor for Ctrl-C).
    (logging.exception if helps else logging.error)(
        "Process %d of %d failed: %s: %s.%s Exiting with status %d.", jax.process_index(), jax.process_count(),
        type(e).__name__, str(e)[:2000].rstrip("."), hint, status)
    failures.exit_now(e, traceback_printed=True)  # the same last line as a single-process run, then os._exit


# ---------------------------------------------------------------------------------------------------
# Start-up consistency check.
# ---------------------------------------------------------------------------------------------------


def _digest(text: str) -> np.ndarray:
  return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.uint32)


def fingerprint(config_json: str, seed: int, mesh, num_replicas: int) -> dict[str, str]:
  """What every process of one job must agree on, as text (hashed before it is compared)."""
  layout = mesh_lib.process_layout(mesh, num_replicas)
  return {
      "config": config_json,
      "seed": str(seed),
      "replica layout": json.dumps({str(p): v for p, v in layout.items()}, sort_keys=True),
      "jax version": jax.__version__,
      "process count": str(jax.process_count()),
  }


_SHOWN = 32  # fields this short are compared and reported as text; longer ones (the config) by hash


def _field_bytes(value: str) -> np.ndarray:
  raw = value.encode()
  text = raw if len(raw) <= _SHOWN else b""
  return np.concatenate([_digest(value).view(np.uint8), np.frombuffer(text.ljust(_SHOWN, b"\0"), np.uint8)])


def _describe(row: np.ndarray) -> str:
  text = row[8:].tobytes().rstrip(b"\0").decode(errors="replace")
  return repr(text) if text else "hash " + row[:8].tobytes().hex()


def _compare_across_processes(fields: dict[str, str]) -> list[str]:
  """Collective: one line per fingerprint field on which the processes disagree (empty when they agree)."""
  rows = np.stack([_field_bytes(v) for v in fields.values()])  # [F, 8 + _SHOWN] uint8
  # A host-side all-gather over every device of the job, independent of the training mesh: it works
  # even when the processes disagree on the config (the thing being checked). Runs once, < 1 KB.
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  gathered = np.asarray(multihost_utils.process_allgather(rows)).reshape((jax.process_count(),) + rows.shape)
  problems = []
  for i, name in enumerate(fields):
    values: dict[bytes, list[int]] = {}
    for p in range(gathered.shape[0]):
      values.setdefault(gathered[p, i].tobytes(), []).append(p)
    if len(values) > 1 and name == "config":
      # Every process saw the same gathered hashes, so all of them run this second gather.
      problems.append(job_checks.describe_config_mismatch(json.loads(fields["config"])))
    elif len(values) > 1:
      groups = "; ".join(f"processes {procs} have {_describe(np.frombuffer(v, np.uint8))}" for v, procs in values.items())
      problems.append(f"{name} differs: {groups}")
  return problems


def _leaf_checksums(x_NxD: jax.Array) -> jax.Array:
  """[N] pairs of uint32 words per replica: two position-weighted sums of the leaf's raw bits.

  The weights are odd, hence invertible mod 2³², so changing any single word of a replica's leaf
  always changes its sums; comparing bits (not values) also tells −0.0 from 0.0 and NaN payloads apart.
  """
  if jnp.issubdtype(x_NxD.dtype, jax.dtypes.prng_key):
    x_NxD = jax.random.key_data(x_NxD)
  if x_NxD.dtype == jnp.bool_:
    x_NxD = x_NxD.astype(jnp.uint8)
  n, itemsize = x_NxD.shape[0], x_NxD.dtype.itemsize
  bits = jax.lax.bitcast_convert_type(x_NxD, jnp.dtype(f"uint{8 * min(itemsize, 4)}"))
  words = bits.reshape(n, -1).astype(jnp.uint32)  # uint32 arithmetic wraps mod 2³²
  i = jnp.arange(words.shape[1], dtype=jnp.uint32)
  w1 = (2 * i + 1) * jnp.uint32(2654435761)
  w2 = (2 * i * i + 1) * jnp.uint32(0x85EBCA6B)  # also odd, and not a constant multiple of w1
  return jnp.stack([jnp.sum(words * w1, axis=1), jnp.sum(words * w2, axis=1)], axis=1)


@functools.cache
def replica_checksum_fn(mesh):
  """Jitted state -> [N, 2] uint32: a checksum of every replica's full state (all leaves, optimizer
  counters included), replicated so that every process reads every replica's sums.

  One function per mesh for the start-up check below and every checkpoint's checksums
  (io/checkpoint/checksum.py): the same program, compiled once a run; a save compiles nothing.
  """
  def checksum(state):
    state = sharding_lib.device_view(state)  # φ, δ may live in host memory (outer.offload)
    terms = [_leaf_checksums(x) * jnp.uint32(2 * j + 1) for j, x in enumerate(jax.tree.leaves(state))]
    return functools.reduce(jnp.add, terms)

  # Each device sums its own replicas; the [N, 2] result is replicated (one tiny all-gather).
  return jax.jit(checksum, out_shardings=mesh_lib.replicated(mesh))


def replica_checksums(mesh, state) -> np.ndarray:
  """[N, 2] uint32: a checksum of every replica's full state (`replica_checksum_fn`)."""
  return np.asarray(replica_checksum_fn(mesh)(state))


def log_layout(mesh, num_replicas: int, batch_size: int, seq_len: int) -> None:
  """Once, on process 0: how the global batch splits over processes, devices and replicas."""
  if jax.process_index() != 0:
    return
  n, b, l = num_replicas, batch_size, seq_len
  layout = mesh_lib.process_layout(mesh, n)
  groups, per_group = mesh.shape[mesh_lib.REPLICA], mesh.devices.size // mesh.shape[mesh_lib.REPLICA]
  lines = [f"Global batch per inner step: {n} replicas × {b} sequences × {l} tokens = {n * b * l} tokens, over "
           f"{len(layout)} process(es), {mesh.devices.size} devices: {groups} replica group(s) of {per_group} "
           f"device(s), {mesh_lib.replicas_per_device(mesh, n)} replica(s) per group. Each process loads only "
           "its own replicas' rows:"]
  for p, entry in layout.items():
    r = entry["replicas"]
    lines.append(f"  process {p}: devices {entry['devices']}, replicas {r} -> {len(r)} × {b} sequences "
                 f"= {len(r) * b * l} tokens per step")
  logging.info("\n".join(lines))


def check_consistency(config_json: str, mesh, state, *, seed: int, num_replicas: int, batch: tuple[int, int],
                      workdir: str | None = None) -> np.ndarray:
  """Raises ConsistencyError unless all processes agree on the config (`config_json`: the whole config as
  sorted JSON text), seed and layout, share `workdir` (when given; job_checks.py), and every
  replica's state is bit-identical to replica 0's. `batch`: (sequences, tokens) per replica, for the layout's
  log line. Returns the [N, 2] replica checksums.

  Call it right after the state is built and before anything (a restore, a step) changes it.
  """
  log_layout(mesh, num_replicas, *batch)
  fields = fingerprint(config_json, seed, mesh, num_replicas)
  logging.info("Start-up check: process %d has config hash %s, seed %s.", jax.process_index(),
               _digest(fields["config"]).tobytes().hex(), seed)
  if jax.process_count() > 1:
    problems = _compare_across_processes(fields)
    if workdir is not None:
      problems.append(job_checks.shared_workdir_problem(workdir))
    problems = [p for p in problems if p]
    if problems:
      raise ConsistencyError(
          "the processes of this job disagree at start-up: " + " | ".join(problems) + ". Start every process "
          "with the same config, overrides, workdir and code version (each process logs its config hash).")
  sums = replica_checksums(mesh, state)
  logging.info("Start-up check: %d processes agree on config, seed and replica layout; replica 0 state "
               "checksum %s.", jax.process_count(), sums[0].tobytes().hex())
  differ = [r for r in range(sums.shape[0]) if not np.array_equal(sums[r], sums[0])]
  if differ:
    owner = {r: p for p, e in mesh_lib.process_layout(mesh, num_replicas).items() for r in e["replicas"]}
    raise ConsistencyError(
        f"Replicas {differ} (on processes {sorted({owner[r] for r in differ})}) do not start bit-identical "
        f"to replica 0 (on process {owner[0]}): state checksums {[sums[r].tobytes().hex() for r in differ]} "
        f"vs {sums[0].tobytes().hex()}. All replicas must start from the same weights.")
  return sums
