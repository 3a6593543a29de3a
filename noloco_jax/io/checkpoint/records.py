"""What a checkpoint's JSON items hold: the meta record, the loop state's host values, compatibility checks.

The `meta/` item (written by process 0) is one JSON object:

    format, step, round, comm_bytes, bytes_sent, bytes_received, history, pending
                                                        (the loop state, `LoopState.to_record()`)
    num_replicas, process_count, pairing, state_shapes, config, method, state_checksums
    digest                                              (checksum.py: SHA-256 of all of the above)

`pairing` is the pairing schedule's parameters (mode, seed, group size, replicas) and the grouping
of the next round; `pending` the host values of training metrics fetched but not yet logged (so a
save between two log steps still resumes to the same logged means); `state_shapes` the shape and
dtype of every state leaf. Arrays travel as {"dtype", "shape", "values"}: float32 → Python float →
JSON → float32 is exact, so restored means are bitwise the same.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

FORMAT = "noloco_jax.io.checkpoint/2"  # /2: the meta and data items carry their own digest (checksum.py)
FORMAT_WITHOUT_DIGESTS = "noloco_jax.io.checkpoint/1"  # still read; its JSON items are not verified


def host(x) -> np.ndarray:
  """A (possibly multi-process) array as one NumPy array on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def array_to_json(x) -> dict:
  a = host(x)
  return {"dtype": a.dtype.name, "shape": list(a.shape), "values": a.ravel().tolist()}


def array_from_json(d: dict) -> np.ndarray:
  return np.asarray(d["values"], dtype=jnp.dtype(d["dtype"])).reshape(d["shape"])


def pending_to_host(steps: list[int], metrics: list[dict], rounds: list[tuple]) -> dict:
  """The training metrics fetched since the last log, as JSON-able host values."""
  return {"steps": [int(s) for s in steps],
          "metrics": [{k: array_to_json(v) for k, v in m.items()} for m in metrics],
          "rounds": [[{k: array_to_json(v) for k, v in m.items()}, None if w is None else array_to_json(w)] for m, w in rounds]}


def pending_from_host(pending: dict) -> tuple[list, list, list]:
  """(pending steps, pending metrics, pending rounds) as the loop keeps them, with NumPy values."""
  metrics = [{k: array_from_json(v) for k, v in m.items()} for m in pending["metrics"]]
  rounds = [({k: array_from_json(v) for k, v in m.items()}, None if w is None else array_from_json(w)) for m, w in pending["rounds"]]
  return list(pending["steps"]), metrics, rounds


def pending_losses(pending: dict) -> np.ndarray:
  """[steps, N] losses of a `pending_to_host` record (empty when nothing is pending)."""
  losses = [array_from_json(m["loss"]) for m in pending["metrics"]]
  return np.stack(losses) if losses else np.zeros((0, 0), np.float32)


def shapes(tree) -> dict[str, list]:
  """{leaf path: [shape, dtype name]}: what must match for a state to restore into another."""
  return {jax.tree_util.keystr(path): [list(x.shape), jnp.dtype(x.dtype).name]
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def schedule_record(schedule, round_: int) -> dict | None:
  """The pairing schedule's parameters and the grouping of round `round_` (None without pairing)."""
  if schedule is None:
    return None
  return {**schedule.record(), "round": int(round_), "groups": [list(g) for g in schedule.groups(round_)]}


def same_schedule_parameters(saved: dict | None, now: dict | None) -> bool:
  """Whether two schedule records (`schedule_record`) have the same parameters (the schedule's own
  `record()`: mode, seed, group size or fan-out, replicas), whatever their round and grouping."""
  keep = lambda p: {k: v for k, v in (p or {}).items() if k not in ("round", "groups")}
  return keep(saved) == keep(now)


def pairing_row(schedule, round_: int, step: int) -> dict:
  """Round `round_`'s row of pairings.jsonl (written by the loop at `step`, the round's last step)."""
  row = {"round": int(round_), "step": int(step), "groups": [list(g) for g in schedule.groups(round_)]}
  if schedule.mode == "round_robin":
    row["matching"] = schedule.index(round_)
  return row


def schedule_differences(saved: dict | None, now: dict | None) -> str:
  """What differs between two `schedule_record`s, in words (e.g. "mode 'fresh' -> 'round_robin'")."""
  if saved is None or now is None:
    return f"saved {'no' if saved is None else 'a'} schedule, now {'none' if now is None else 'one'}"
  keys = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
  return ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" if k != "groups" else "groups of round "
                   f"{now.get('round')}" for k in keys)


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[str]:
  """Dotted names of the fields that differ, ignoring those that cannot change the numbers."""
  ignore = {"checkpoint", "num_devices", "checkpoint_every", "log_every", "log_barrier", "data.prefetch", "wandb"}
  out = []
  for key in sorted(set(saved) | set(now)):
    name = prefix + key
    if name in ignore:
      continue
    a, b = saved.get(key), now.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_changes(a, b, name + ".")
    elif a != b:
      out.append(f"{name}: {a!r} -> {b!r}")
  return out


def loop_record(meta: dict) -> dict[str, Any]:
  """The loop state's part of a meta record (what `LoopState.from_record` reads)."""
  record = {k: meta[k] for k in ("step", "round", "comm_bytes", "history", "pending")}
  # Absent from older checkpoints: the round driver's record (before it, streaming overlap's step in flight),
  # the wire counts (outer/wire.py; the loop then fills them: LoopState.fill_wire_bytes).
  for key in ("driver", "inflight_step", "bytes_sent", "bytes_received"):
    if key in meta:
      record[key] = meta[key]
  return record


def saved_method(meta: dict) -> str | None:
  """The outer method that saved the checkpoint (OuterMethod.kind). Checkpoints written before the meta
  item named it carry it only in their config record."""
  if "method" in meta:
    return meta["method"]
  return meta.get("config", {}).get("outer", {}).get("kind")
