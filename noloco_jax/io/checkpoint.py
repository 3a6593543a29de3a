"""Checkpoints and exact resume; preemption (SIGTERM); corrupt-checkpoint fallback; the NaN guard.

What one checkpoint holds (an orbax step directory `workdir/checkpoints/<step>/`):

- `state/`: the whole replica-stacked TrainState (θ, inner optimizer state, φ, δ, step counters),
  saved sharded as it lives on the mesh: each process writes only the shards of its own replicas.
- `meta/`: JSON written by process 0: step, outer round, cumulative comm bytes, the pairing
  schedule's parameters (mode, seed, group size, replicas) and the grouping of the next round,
  the metric history, the host values of training metrics fetched but not yet logged (so a save
  between two log steps still resumes to the same logged means), the shapes of every state leaf
  and the config.
- `data/`: JSON, one file per process (`process_<i>.json`), the stream position of each replica
  that process holds. Restore reads every file and each process takes its own replicas, so a
  checkpoint restores under another process count or device layout.

Where a run starts, first match wins:

1. its own workdir: the latest readable checkpoint in `workdir/checkpoints` (exact resume: state,
   data positions, round, comm bytes, metric history);
2. `config.checkpoint.warm_start`: a path to another run's workdir, its `checkpoints` directory or
   one step directory. Only the fast weights θ of every replica are taken (the replica count and
   model must match); φ = θ, δ = 0, a fresh inner optimizer, step 0 and the data from the start:
   a new run that begins from trained weights;
3. scratch: the initial weights of `config.seed`.

Resuming:

- Rows of `metrics.jsonl` and `pairings.jsonl` that the interrupted run wrote after the restored
  step (and a last line cut by the kill) are dropped when the run resumes, with a warning saying how
  many; the resumed run then writes those steps again, identically. TensorBoard event files are
  append-only and keep the interrupted run's points past the checkpoint.
- Orbax writes a step into a temporary directory and renames it only when every item is complete;
  steps beyond `config.checkpoint.keep` are deleted only after a newer step is complete. A step
  whose files are unreadable (truncated, partly deleted) fails to restore: the run warns, moves it
  to `workdir/checkpoints_corrupt/` and takes the previous step. When no step is readable it stops
  with an error rather than silently training from scratch.
- A checkpoint saved with another replica count, model, optimizer, outer method or pairing schedule
  is an error, not a fallback. Another device count or process count is fine: arrays are resharded
  on restore.

Preemption: SIGTERM sets a flag (`install_preemption_handler`, called by main.py). Single-process
jobs read it after every step; multi-process jobs agree on it at every log step with one all-gather
of a 4-byte flag (log steps already wait for the host, so this adds nothing to the step pipeline),
so every process stops at the same step. The loop then saves at that step and returns; main exits 0.

Non-finite values: no state is saved until the losses since the last log and the state itself are
checked finite. `config.nan_policy = "error"` stops the run at the first non-finite loss (naming the
step and the replica), leaving the last good checkpoint as it was. `"skip_round"`: see `RoundGuard`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as py_logging
import os
import shutil
import signal
import threading
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.training.state import TrainState

FORMAT = "noloco_jax.io.checkpoint/1"
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"
LOG_FILES = ("metrics.jsonl", "pairings.jsonl")  # rows keyed by "step", rewritten on resume


class IncompatibleCheckpointError(ValueError):
  """The checkpoint is readable but was saved by a different setup: never a reason to fall back."""


class NonFiniteStateError(FloatingPointError):
  """The state holds NaN or Inf; raised instead of saving it."""


# ---------------------------------------------------------------------------------------------------
# Preemption: a flag set by SIGTERM, read by the loop after every step.
# ---------------------------------------------------------------------------------------------------

_STOP = threading.Event()


def install_preemption_handler() -> None:
  """On SIGTERM, finish the current step, save, and return from the loop (main then exits 0)."""
  def on_sigterm(signum, frame):
    del signum, frame
    _STOP.set()  # Only set a flag: a signal handler must not touch JAX or the checkpoint manager.
  signal.signal(signal.SIGTERM, on_sigterm)


def stop_requested(step: int, sync_every: int) -> bool:
  """Whether to stop after `step`; the same answer on every process of a job."""
  if jax.process_count() == 1:
    return _STOP.is_set()
  if step % max(sync_every, 1):
    return False
  flags = multihost_utils.process_allgather(np.int32(_STOP.is_set()))
  return bool(np.max(flags))


# ---------------------------------------------------------------------------------------------------
# The per-process data item: each process writes its own file; restore returns all of them.
# ---------------------------------------------------------------------------------------------------


class _PerProcessJsonHandler(ocp.JsonCheckpointHandler):
  """Orbax's JSON handler, but every process writes (primary_host=None) a file of its own."""

  def __init__(self):
    super().__init__(filename=f"process_{jax.process_index()}.json",
                     multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))

  def restore(self, directory, item=None, args=None) -> dict[str, Any]:
    del item, args
    files = sorted(directory.glob("process_*.json"))
    if not files:
      raise FileNotFoundError(f"no process_*.json in {directory}")
    return {f.name: json.loads(f.read_text()) for f in files}


@ocp.args.register_with_handler(_PerProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class _PerProcessJsonSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(_PerProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class _PerProcessJsonRestore(ocp.args.CheckpointArgs):
  pass


def _merge_data_states(files: dict[str, Any]) -> dict:
  """One iterator state holding every replica of the job, from the per-process files."""
  states = [f["iterator"] for f in files.values()]
  merged = {**states[0], "replicas": {}}
  for s in states:
    if s.get("format") != merged.get("format") or s.get("config") != merged.get("config"):
      raise ValueError(f"data item: process files disagree: {s.get('config')} vs {merged.get('config')}")
    merged["replicas"].update(s["replicas"])
  return merged


# ---------------------------------------------------------------------------------------------------
# Host values that travel in the JSON item.
# ---------------------------------------------------------------------------------------------------


def _host(x) -> np.ndarray:
  """A (possibly multi-process) array as one NumPy array on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _array_to_json(x) -> dict:
  a = _host(x)
  return {"dtype": a.dtype.name, "shape": list(a.shape), "values": a.ravel().tolist()}


def _array_from_json(d: dict) -> np.ndarray:
  # float32 → Python float → JSON → float32 is exact, so restored means are bitwise the same.
  return np.asarray(d["values"], dtype=jnp.dtype(d["dtype"])).reshape(d["shape"])


def pending_to_host(steps: list[int], metrics: list[dict], rounds: list[tuple]) -> dict:
  """The training metrics fetched since the last log, as JSON-able host values."""
  return {"steps": [int(s) for s in steps],
          "metrics": [{k: _array_to_json(v) for k, v in m.items()} for m in metrics],
          "rounds": [[{k: _array_to_json(v) for k, v in m.items()}, _array_to_json(w)] for m, w in rounds]}


def pending_from_host(pending: dict) -> tuple[list, list, list]:
  """(pending_steps, pending_metrics, pending_round) as the loop keeps them, with NumPy values."""
  metrics = [{k: _array_from_json(v) for k, v in m.items()} for m in pending["metrics"]]
  rounds = [({k: _array_from_json(v) for k, v in m.items()}, _array_from_json(w)) for m, w in pending["rounds"]]
  return list(pending["steps"]), metrics, rounds


def pending_losses(pending: dict) -> np.ndarray:
  """[steps, N] losses of a `pending_to_host` record (empty when nothing is pending)."""
  losses = [_array_from_json(m["loss"]) for m in pending["metrics"]]
  return np.stack(losses) if losses else np.zeros((0, 0), np.float32)


def _shapes(tree) -> dict[str, list]:
  return {jax.tree_util.keystr(path): [list(x.shape), jnp.dtype(x.dtype).name]
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _schedule_record(schedule, round_: int) -> dict | None:
  if schedule is None:
    return None
  return {**schedule.record(), "round": int(round_), "groups": [list(g) for g in schedule.groups(round_)]}


@functools.cache
def _replica_finite_fn(mesh):
  """Jitted state → [N] bool, replicated so every process can read it: is replica r all finite?"""
  def finite(state):
    state = sharding_lib.device_view(state)  # φ, δ may live in host memory (outer.offload)
    ok = [jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
          for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, ok)
  return jax.jit(finite, out_shardings=mesh_lib.replicated(mesh))


def nonfinite_replicas(state: TrainState, mesh) -> list[int]:
  return [int(r) for r in np.flatnonzero(~np.asarray(_replica_finite_fn(mesh)(state)))]


def _everywhere(ok: bool) -> bool:
  """True only if `ok` on every process (one all-gather of a flag in multi-process jobs)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def drop_rows_after(path: str, step: int) -> int:
  """Rewrites a JSONL log keeping the rows with "step" ≤ `step`; returns how many were dropped.

  A line that does not parse (the last line of a killed writer) is dropped and counted too.
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if int(row.get("step", 0)) <= step:
      keep.append(line if line.endswith("\n") else line + "\n")
  dropped = len([l for l in lines if l.strip()]) - len(keep)
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, path)  # atomic: a crash here leaves either the old or the new file
  return dropped


# ---------------------------------------------------------------------------------------------------
# The checkpointer.
# ---------------------------------------------------------------------------------------------------


class _QuietOrbax(py_logging.Filter):
  """Drops orbax's INFO lines (some thirty per save) from absl's log; its warnings and errors stay."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return record.levelno >= py_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


_QUIET_ORBAX = _QuietOrbax()


@dataclasses.dataclass
class Resume:
  """Where the loop picks up: everything besides the state that it keeps across steps."""
  step: int
  round: int
  comm_bytes: int
  history: dict
  pending: tuple[list, list, list]  # (pending_steps, pending_metrics, pending_round), host values


class Checkpointer:
  """Saves and restores one run's checkpoints in `workdir/checkpoints`. All processes call every method."""

  def __init__(self, setup, workdir: str):
    self._setup, self._config = setup, setup.config
    self._workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self._workdir, CHECKPOINT_DIR)
    ck = self._config.checkpoint
    py_logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # a no-op when already added
    self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=ck.keep, enable_async_checkpointing=ck.async_save, create=True,
        cleanup_tmp_directories=True))  # leftovers of an interrupted write are never restored

  def due(self, step: int) -> bool:
    every = self._config.checkpoint_every
    return step == self._config.num_steps or (every > 0 and step % every == 0)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  # ---- save ----

  def save(self, step: int, state: TrainState, train_iter, *, round_: int, comm_bytes: int,
           history: dict, pending: dict) -> None:
    """Starts saving `state` after `step` (asynchronously if configured); returns once it is safe
    to keep training (the device arrays have been copied)."""
    bad = nonfinite_replicas(state, self._setup.mesh)
    if bad:
      self._manager.wait_until_finished()
      raise NonFiniteStateError(
          f"the state after step {step} holds NaN or Inf on replica(s) {bad}; it was not saved. The last "
          f"good checkpoint is step {self.latest_step()} in {self.directory}.")
    meta = {
        "format": FORMAT, "step": int(step), "round": int(round_), "comm_bytes": int(comm_bytes),
        "num_replicas": self._config.num_replicas, "process_count": jax.process_count(),
        "pairing": _schedule_record(self._setup.schedule, round_),
        "state_shapes": _shapes(state), "history": history, "pending": pending,
        "config": json.loads(self._config.to_json_best_effort()),
    }
    data = {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "iterator": train_iter.get_state()}
    start = time.time()
    self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta), data=_PerProcessJsonSave(data)))
    logging.info("checkpoint: step %d %s in %.2f s -> %s", step,
                 "started (async)" if self._config.checkpoint.async_save else "saved",
                 time.time() - start, self.directory)

  def wait_until_finished(self) -> None:
    """Blocks until every save started so far is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last asynchronous save to be complete."""
    self._manager.wait_until_finished()
    self._manager.close()

  # ---- restore ----

  def restore(self, state: TrainState, train_iter) -> tuple[TrainState, Resume | None]:
    """The state to start from (own checkpoint, else warm start, else the fresh `state`) and, when
    resuming, where the loop picks up. Positions `train_iter` and rewrites the logs when resuming.

    Consumes `state`: when the workdir holds checkpoints its buffers are freed before reading, so
    that a model that fits in memory once is never held twice. `state` may also be abstract
    (`jax.eval_shape(setup.init_state)`) when the caller knows it will not be needed.
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    steps = sorted(self._manager.all_steps(), reverse=True)
    if steps:
      jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state)
    bad = []
    for step in steps:
      meta, state, data, error = self._read(step, abstract)
      if not _everywhere(error is None):
        logging.warning("checkpoint: step %d in %s is not readable (%s: %s); trying the previous one.",
                        step, self.directory, type(error).__name__, str(error)[:300])
        bad.append(step)
        continue
      self._quarantine(bad)
      train_iter.set_state(data)
      for name in LOG_FILES:
        path = os.path.join(self._workdir, name)
        if jax.process_index() == 0 and (dropped := drop_rows_after(path, step)):
          logging.warning("resume: dropped %d row(s) of %s written after step %d by the interrupted run; "
                          "they are written again from here.", dropped, path, step)
      logging.info("checkpoint: resumed from step %d (round %d) in %s.", step, meta["round"], self.directory)
      resume = Resume(step=step, round=meta["round"], comm_bytes=meta["comm_bytes"],
                      history=meta["history"], pending=pending_from_host(meta["pending"]))
      return state, resume
    if bad:
      raise RuntimeError(f"no readable checkpoint in {self.directory} (steps {bad} all failed, see the "
                         "warnings above); move the directory away to start this workdir from scratch.")
    if self._config.checkpoint.warm_start:
      return self._warm_start(state, abstract), None
    return state, None

  def _read(self, step: int, abstract) -> tuple[dict | None, Any, dict | None, Exception | None]:
    """(meta, state, data state, None) or (..., the error) when a file of the step is unreadable."""
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      if meta.get("format") != FORMAT or meta.get("step") != step:
        raise ValueError(f"meta item: format {meta.get('format')!r}, step {meta.get('step')!r}")
    except Exception as e:  # pylint: disable=broad-except
      return None, None, None, e
    self._check_compatible(meta, abstract, step)  # outside the try: a different setup is an error
    try:
      items = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=_PerProcessJsonRestore()))
      return meta, items["state"], _merge_data_states(items["data"]), None
    except Exception as e:  # pylint: disable=broad-except
      return meta, None, None, e

  def _check_compatible(self, meta: dict, abstract, step: int) -> None:
    where = f"checkpoint step {step} in {self.directory}"
    saved, now = meta["state_shapes"], _shapes(abstract)
    if saved != now:
      diff = [f"{k}: saved {saved.get(k)}, now {now.get(k)}" for k in sorted(set(saved) | set(now))
              if saved.get(k) != now.get(k)]
      raise IncompatibleCheckpointError(
          f"{where} holds a state of another shape (num_replicas, model, optimizer or outer method "
          f"changed): {diff[:5]}{' ...' if len(diff) > 5 else ''}. Use a new workdir, or start from its "
          "weights with config.checkpoint.warm_start.")
    expected = _schedule_record(self._setup.schedule, meta["round"])
    if meta["pairing"] != expected:
      raise IncompatibleCheckpointError(
          f"{where} was saved under another pairing schedule: saved {meta['pairing']}, now {expected}. "
          "Resume with the same seed and outer.pairing / group_size.")
    changed = _config_changes(meta.get("config", {}), json.loads(self._config.to_json_best_effort()))
    if changed:
      logging.warning("resume: the config differs from the checkpoint's in %s; the resumed run is exact "
                      "only for changes of layout (num_devices) or checkpointing.", changed)

  def _quarantine(self, steps: list[int]) -> None:
    """Moves unreadable steps out of orbax's sight, so that later saves may reuse their numbers."""
    if not steps:
      return
    if jax.process_index() == 0:
      target_root = os.path.join(self._workdir, CORRUPT_DIR)
      os.makedirs(target_root, exist_ok=True)
      for step in steps:
        target = os.path.join(target_root, f"{step}-{int(time.time())}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        logging.warning("checkpoint: moved unreadable step %d to %s.", step, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("noloco_jax.io.checkpoint.quarantine")
    self._manager.reload()

  def _warm_start(self, state: TrainState, abstract) -> TrainState:
    """θ of every replica from another run's checkpoint; everything else fresh (see module docstring)."""
    root, step = _resolve_warm_start(self._config.checkpoint.warm_start)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = {k: v for k, v in meta["state_shapes"].items() if k.startswith(".params")}
    now = {k: v for k, v in _shapes(abstract).items() if k.startswith(".params")}
    if saved != now:
      raise IncompatibleCheckpointError(
          f"config.checkpoint.warm_start={self._config.checkpoint.warm_start!r}: its weights (step {step}) "
          "do not fit this run's replicas and model: "
          f"{[k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)][:5]}.")
    target = {"params": abstract.params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
    params = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True)))["state"]["params"]
    manager.close()
    sharding = jax.tree.map(lambda x: x.sharding, abstract.outer)
    outer = jax.jit(jax.vmap(self._setup.method.init), out_shardings=sharding)(params)
    logging.info("checkpoint: warm start from the weights of step %d in %s.", step, root)
    return state.replace(params=params, outer=outer)


def _resolve_warm_start(path: str) -> tuple[str, int]:
  """(checkpoints root, step) for a workdir, a checkpoints directory or a step directory."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), int(os.path.basename(path))
  if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
    path = os.path.join(path, CHECKPOINT_DIR)
  steps = [int(n) for n in os.listdir(path) if n.isdigit()] if os.path.isdir(path) else []
  if not steps:
    raise FileNotFoundError(f"config.checkpoint.warm_start={path!r} holds no checkpoint (a workdir, its "
                            "checkpoints directory, or one step directory).")
  return path, max(steps)


def _config_changes(saved: dict, now: dict, prefix: str = "") -> list[str]:
  """Dotted names of the fields that differ, ignoring those that cannot change the numbers."""
  ignore = {"checkpoint", "num_devices", "checkpoint_every", "log_every", "data.prefetch"}
  out = []
  for key in sorted(set(saved) | set(now)):
    name = prefix + key
    if name in ignore:
      continue
    a, b = saved.get(key), now.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_changes(a, b, name + ".")
    elif a != b:
      out.append(f"{name}: {a!r} -> {b!r}")
  return out


# ---------------------------------------------------------------------------------------------------
# nan_policy = "skip_round".
# ---------------------------------------------------------------------------------------------------


class RoundGuard:
  """Undoes a round whose training loss or resulting state is not finite (`nan_policy="skip_round"`).

  A round is the window of H inner steps ending at a step that is a multiple of H (and the outer
  step run there). The guard copies the state at the round's start (one more copy of the state in
  device memory) and, at the round's end, after the outer step, fetches the round's losses and
  checks the state (one host round-trip per round). If anything is NaN or Inf, on any replica:

  - every replica's θ, inner optimizer state (its step count included, so the learning-rate
    schedule does not advance), φ and δ return to their values at the round's start;
  - the round's batches stay consumed (the data moves on), the loop step and round counters
    advance, and the bytes the outer step sent stay counted: they were sent;
  - the round's metrics are logged as they were (possibly "nan"), a warning names the round, and
    `history["skipped_rounds"]` records [first step, last step] of every skipped round.

  With any other policy the guard does nothing. After resuming in the middle of a round (from a
  preemption save), a skip returns to the resumed state rather than the round's start.
  """

  def __init__(self, config, mesh):
    self.enabled = config.nan_policy == "skip_round"
    self._H, self._mesh = config.outer.inner_steps, mesh
    self._snapshot, self._losses, self._first = None, [], 0

  def begin(self, step: int, state: TrainState) -> None:
    if self.enabled and (self._snapshot is None or (step - 1) % self._H == 0):
      # A real copy, in the leaf's own memory space: the inner step donates `state`, and a copy
      # made inside jit could be forwarded instead of copied.
      self._snapshot = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
      self._losses, self._first = [], step

  def observe(self, loss_N) -> None:
    if self.enabled:
      self._losses.append(loss_N)

  def end(self, step: int, state: TrainState, history: dict) -> TrainState:
    if not self.enabled or step % self._H:
      return state
    losses = np.stack([_host(x) for x in self._losses])
    bad_loss, bad_state = np.argwhere(~np.isfinite(losses)), nonfinite_replicas(state, self._mesh)
    snapshot, self._snapshot = self._snapshot, None
    if not len(bad_loss) and not bad_state:
      return state
    why = (f"loss {losses[tuple(bad_loss[0])]} at step {self._first + bad_loss[0][0]} on replica {bad_loss[0][1]}"
           if len(bad_loss) else f"non-finite state on replica(s) {bad_state}")
    logging.warning("nan_policy=skip_round: undoing the round of steps %d-%d (%s); training goes on from the "
                    "state at step %d with the next round's batches.", self._first, step, why, self._first - 1)
    history.setdefault("skipped_rounds", []).append([self._first, step])
    return snapshot
