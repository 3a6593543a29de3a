"""Elastic resume: a checkpoint of N replicas resumed with other replicas (config.checkpoint.elastic).

The modes (drop, recreate, grow), what each replica's new state is made of and why, and what happens to
the loop state, the pairing schedule, the data and the logs: docs/elastic.md. L, the lost replicas, is
`checkpoint.elastic_replicas`, or by default those the missing processes held: the checkpoint's data
item names each saving process's replicas, and the processes the job no longer has are those numbered ≥
the current process count (a launcher numbers the survivors 0 … P'−1).

The plans are pure NumPy functions of the checkpoint's records and the config, identical on every
process, each with a NumPy test (tests/test_elastic.py); the train state follows one row map `source`
(new replica i ← old replica source[i]). The last section reads the checkpoint's state into host memory
and places the resized one on the mesh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from noloco_jax.config.checkpoint import parse_replica_list
from noloco_jax.io.checkpoint import checksum
from noloco_jax.runtime import distributed
from noloco_jax.parallel import permutations


class ResizeError(ValueError):
  """The elastic setting does not fit the checkpoint; the message names the field and what would."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """How the checkpoint's N replicas become the run's N'."""
  mode: str  # drop | recreate | grow
  old_n: int
  new_n: int
  source: tuple[int, ...]  # new replica i is built from old replica source[i]
  dropped: tuple[int, ...] = ()  # old ids
  recreated: dict[int, int] = dataclasses.field(default_factory=dict)  # old id -> the old id it copies
  added: dict[int, int] = dataclasses.field(default_factory=dict)  # new id -> the peer (old id) it starts from

  @property
  def keeps_data(self) -> bool:
    """Whether every replica keeps its data stream and position (same N: the deal is unchanged)."""
    return self.old_n == self.new_n

  def event(self, step: int, round_: int) -> dict[str, Any]:
    """The JSONL record of the change (elastic.jsonl, pairings.jsonl)."""
    return {"step": int(step), "round": int(round_), "elastic": self.mode, "replicas_before": self.old_n,
            "replicas_after": self.new_n, "dropped": list(self.dropped),
            "recreated_from": {str(k): v for k, v in sorted(self.recreated.items())},
            "added_from": {str(k): v for k, v in sorted(self.added.items())},
            "kept": {str(i): s for i, s in enumerate(self.source) if i not in self.recreated
                     and i not in self.added}, "data": "kept" if self.keeps_data else "dealt afresh"}

  def describe(self) -> str:
    """One log line."""
    if self.mode == "drop":
      what = f"dropped replicas {list(self.dropped)}; new replica i is old replica {list(self.source)}[i]"
    elif self.mode == "recreate":
      what = "re-created " + ", ".join(f"{r} from {s}" for r, s in sorted(self.recreated.items()))
    else:
      what = "added " + ", ".join(f"{i} from {p}'s slow weights" for i, p in sorted(self.added.items()))
    return f"elastic resume ({self.mode}): {self.old_n} -> {self.new_n} replicas; {what}."


# ---- Whether the checkpoint is resumed elastically ----


def mode_for(meta: dict, num_replicas: int, checkpoint_cfg) -> str | None:
  """The elastic mode of this resume with `num_replicas` and config.checkpoint (`checkpoint_cfg`), None for
  a plain one; a ResizeError (one line naming config.checkpoint.elastic) when the replica count changed and
  the config does not say how."""
  old_n, new_n, mode = int(meta["num_replicas"]), num_replicas, checkpoint_cfg.elastic
  if old_n == new_n:
    if mode != "recreate":
      return None
    saved = meta.get("config", {}).get("checkpoint", {})
    named = checkpoint_cfg.elastic_replicas
    if named and saved.get("elastic") == "recreate" and saved.get("elastic_replicas") == named:
      return None  # saved by the run that re-created them: resumed as it is
    return "recreate"
  wanted = "drop" if new_n < old_n else "grow"
  if mode == wanted:
    return mode
  change = (f"set config.checkpoint.elastic=drop to drop {old_n - new_n} lost replicas" if wanted == "drop" else
            f"set config.checkpoint.elastic=grow to add {new_n - old_n} replicas")
  if not mode:
    raise ResizeError(f"it holds {old_n} replicas and config.num_replicas={new_n}: resume with "
                      f"num_replicas={old_n}, or {change} (docs/elastic.md)")
  raise ResizeError(f"config.checkpoint.elastic={mode!r} does not resume {old_n} replicas as "
                    f"config.num_replicas={new_n} ('recreate' keeps the count); {change}")


def other_differences(saved_shapes: dict, now_shapes: dict, saved_pairing, now_pairing) -> str | None:
  """Why a checkpoint cannot be resized into this run (records.shapes / schedule_record forms), or None:
  every leaf must match with the replica axis left out, and the pairing schedule but for its N."""
  strip = lambda v: None if v is None else [v[0][1:], v[1]]
  diff = [k for k in sorted(set(saved_shapes) | set(now_shapes)) if strip(saved_shapes.get(k)) != strip(now_shapes.get(k))]
  if diff:
    return (f"holds replicas of another shape (model, optimizer or outer method changed); state leaves: "
            f"{diff[:3]}{' ...' if len(diff) > 3 else ''}")
  keep = lambda p: {k: v for k, v in (p or {}).items() if k not in ("num_replicas", "groups", "round")}
  if keep(saved_pairing) != keep(now_pairing):
    return "was saved under another pairing schedule (seed, outer.pairing or group_size)"
  return None


# ---- Which replicas were lost ----


def held_by_process(data_files: dict[str, Any]) -> dict[int, list[int]]:
  """{saved process index: the replica ids it held}, from the checkpoint's per-process data files."""
  return {int(f["process_index"]): sorted(int(r) for r in f["iterator"]["replicas"]) for f in data_files.values()}


def lost_replicas(elastic_replicas: str, held: dict[int, list[int]], process_count: int, old_n: int) -> list[int]:
  """The named replicas, or those of the saved processes numbered ≥ `process_count`."""
  named = parse_replica_list(elastic_replicas)
  if named:
    bad = [r for r in named if r >= old_n]
    if bad:
      raise ResizeError(f"config.checkpoint.elastic_replicas={elastic_replicas!r} is not valid: the checkpoint "
                        f"has replicas 0 … {old_n - 1}; {bad} do not exist.")
    return sorted(named)
  return sorted(r for p, ids in held.items() if p >= process_count for r in ids)


# ---- The three plans (pure) ----


def plan_drop(old_n: int, lost: list[int]) -> Plan:
  kept = tuple(r for r in range(old_n) if r not in set(lost))
  return Plan("drop", old_n, len(kept), kept, dropped=tuple(sorted(lost)))


def last_partners(groupings, lost: list[int], survivors: list[int], rng_for, directed: bool = False) -> dict[int, int]:
  """{lost r: its last surviving partner}. `groupings` yields the rounds' groupings latest first, each
  a tuple of groups; `directed`: each group is (replica, the replicas it received from), so only its
  first member looks for a partner in it. `rng_for(r)` is the seeded fallback's generator."""
  out, left, alive = {}, set(lost), set(survivors)
  for grouping in groupings:
    for group in grouping:
      members = [int(m) for m in group]
      for r in [m for m in (members[:1] if directed else members) if m in left]:
        partner = next((m for m in members if m in alive), None)
        if partner is not None:
          out[r] = partner
          left.discard(r)
    if not left:
      break
  for r in sorted(left):  # never grouped with a survivor: a seeded draw among them
    out[r] = int(survivors[rng_for(r).integers(len(survivors))])
  return out


def _groups(schedule, round_: int):
  """Round `round_`'s groups: pairing.py's groupings as they are; an epidemic graph (outer/epidemic.py:
  matchings, matching[g] = the replica g received from, or −1) as (g, the replicas it received from)."""
  grouping = schedule.groups(round_)
  if not hasattr(schedule, "fanout"):
    return grouping
  num = len(grouping[0]) if grouping else 0
  return tuple((g, *(int(m[g]) for m in grouping if m[g] >= 0)) for g in range(num))


def plan_recreate(old_n: int, partners: dict[int, int]) -> Plan:
  source = tuple(partners.get(r, r) for r in range(old_n))
  return Plan("recreate", old_n, old_n, source, recreated=dict(sorted(partners.items())))


def grow_peers(old_n: int, new_n: int, seed: int, step: int) -> list[int]:
  """The peer of each new replica N … N'−1: a seeded permutation of the old ones, repeated as needed."""
  perm = permutations.generator(permutations.STREAM_ELASTIC, seed, step, 1).permutation(old_n)
  return [int(perm[j % old_n]) for j in range(new_n - old_n)]


def plan_grow(old_n: int, new_n: int, seed: int, step: int) -> Plan:
  peers = grow_peers(old_n, new_n, seed, step)
  return Plan("grow", old_n, new_n, tuple(range(old_n)) + tuple(peers),
              added={old_n + j: p for j, p in enumerate(peers)})


def make_plan(*, mode: str, elastic_replicas: str, old_n: int, new_n: int, held: dict[int, list[int]],
              process_count: int, seed: int, step: int, rounds_done: int, schedule) -> Plan | None:
  """The plan for resuming `old_n` replicas as `new_n` under `mode` (None: nothing to change)."""
  if mode == "grow":
    return plan_grow(old_n, new_n, seed, step)
  lost = lost_replicas(elastic_replicas, held, process_count, old_n)
  source = (f"config.checkpoint.elastic_replicas={elastic_replicas!r}" if elastic_replicas else
            f"held by process(es) {sorted(p for p in held if p >= process_count)} of the {len(held)} that saved it; "
            f"the job now has {process_count}")
  if mode == "drop":
    if len(lost) != old_n - new_n or len(lost) == old_n:
      raise ResizeError(f"config.checkpoint.elastic='drop': the checkpoint has {old_n} replicas and "
                        f"config.num_replicas={new_n}, so {old_n - new_n} must be dropped, but the lost replicas "
                        f"are {lost} ({source}); name the ones to drop in config.checkpoint.elastic_replicas.")
    return plan_drop(old_n, lost)
  if not lost:
    return None  # recreate with nothing lost: a plain resume
  survivors = [r for r in range(old_n) if r not in set(lost)]
  if not survivors:
    raise ResizeError(f"config.checkpoint.elastic='recreate': every replica is lost ({source}); nothing to copy.")
  groupings = (_groups(schedule, t) for t in range(rounds_done - 1, -1, -1)) if schedule is not None else ()
  rng_for = lambda r: permutations.generator(permutations.STREAM_ELASTIC, seed, step, 2, r)
  directed = hasattr(schedule, "fanout")  # an epidemic graph: who received from whom
  return plan_recreate(old_n, last_partners(groupings, lost, survivors, rng_for, directed))


# ---- Applying a plan: the state, the loop record (NumPy rows) ----


def _rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
  return np.asarray(x)[rows]


def resize_state(state, plan: Plan, new_replica=None):
  """The host state [N, ...] -> [N', ...]: rows by `plan.source`; then each new replica of "grow" is made
  from its peer's row by `new_replica(params, outer) -> (params, outer)`, the outer method's rule
  (outer/base.OuterMethod.new_replica: NoLoCo's gives θ = φ, δ = 0, no residual, an in-flight mean of
  its own message; the module docstring says why). The inner optimizer's state stays the peer's.
  Leaves are NumPy arrays."""
  source = np.asarray(plan.source, np.int64)
  new = jax.tree.map(lambda x: _rows(x, source), state)
  if not plan.added or new_replica is None:
    return new
  params, outer = jax.tree.map(np.array, (new.params, new.outer))  # writable copies
  for r in sorted(plan.added):
    row = jax.tree.map(lambda x: x[r], (params, outer))
    made = new_replica(*row)
    jax.tree.map(lambda dst, src: dst.__setitem__(r, src), (params, outer), made)
  return new.replace(params=params, outer=outer)


def _resize_json_array(d: dict, plan: Plan) -> dict:
  if plan.mode == "recreate" or not d["shape"] or d["shape"][0] != plan.old_n:
    return d  # recreate: each replica's own past metrics, the lost ones' included
  a = np.asarray(d["values"], np.float64).reshape(d["shape"])
  if plan.mode == "drop":
    a = a[np.asarray(plan.source, np.int64)]
  else:  # grow: the new rows are the old mean, which every mean over these steps then keeps
    a = np.concatenate([a, np.broadcast_to(a.mean(axis=0), (plan.new_n - plan.old_n,) + a.shape[1:])])
  return {"dtype": d["dtype"], "shape": list(a.shape), "values": a.astype(d["dtype"]).ravel().tolist()}


def resize_loop_record(record: dict, plan: Plan) -> dict:
  """The loop record with its pending per-replica metrics ([N] arrays) for N' replicas (module docstring)."""
  pending = record["pending"]
  metrics = [{k: _resize_json_array(v, plan) for k, v in m.items()} for m in pending["metrics"]]
  rounds = [[{k: _resize_json_array(v, plan) for k, v in m.items()}, w] for m, w in pending["rounds"]]
  return {**record, "pending": {**pending, "metrics": metrics, "rounds": rounds}}


def data_note(plan: Plan, step: int, batch_size: int) -> str:
  """What happens to the data streams, for the log (docs/elastic.md, "Data")."""
  if plan.keeps_data:
    moved = ", ".join(f"replica {r} reads its own stream on (it is no copy of {s}'s)" for r, s in plan.recreated.items())
    return f"data: every replica continues its stream at its saved position (nothing read twice or skipped){'; ' + moved if moved else ''}."
  read = step * batch_size * plan.old_n
  return (f"data: the deal of sequences to replicas depends on the replica count, so the data is dealt afresh over "
          f"{plan.new_n} replicas and every stream starts at its beginning (as a new run with {plan.new_n} replicas "
          f"would read it): a new pass over the split begins, so the {read} sequences read before step {step} "
          f"({plan.old_n} replicas × {step} steps × {batch_size}) are read again within it, and the interrupted pass "
          "is not completed first.")


# ---- Reading the checkpoint's state into host memory, placing the resized one ----


def read_host_state(directory: str, step: int, abstract, meta: dict):
  """The checkpoint's whole state ([N, ...] leaves, N of the checkpoint) as NumPy arrays on every
  process, its per-replica checksums verified. Read from the step's `state` item directly: the run's
  CheckpointManager binds that item to the handler it saves with (StandardSave)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  (the plans need no orbax)
  old_n = int(meta["num_replicas"])
  item = jax.tree.map(lambda x: jax.ShapeDtypeStruct((old_n,) + tuple(x.shape[1:]), x.dtype), abstract)
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  with ocp.PyTreeCheckpointer() as reader:
    state = reader.restore(os.path.join(directory, str(step), "state"),
                           args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
  if meta.get("state_checksums") not in (None, host_checksums(state)):
    raise checksum.StateChecksumError("the state read back does not match the checksums stored at save time")
  return state


def host_checksums(state) -> list[str]:
  """io/checkpoint/checksum.py's per-replica checksums of a host state, one leaf at a time on this
  process's default device (no collective: every process holds the whole state)."""
  total = None
  for j, x in enumerate(jax.tree.leaves(state)):
    term = np.asarray(distributed._leaf_checksums(np.asarray(x))) * np.uint32(2 * j + 1)  # pylint: disable=protected-access
    total = term if total is None else total + term
  return [row.tobytes().hex() for row in total.astype(np.uint32)]


def place(state, shardings):
  """The host state as global arrays with the run's shardings (each process fills its own shards)."""
  def one(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(one, state, shardings)
