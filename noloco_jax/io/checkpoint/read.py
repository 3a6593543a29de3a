"""Reading one checkpoint step outside a training run: every replica's weights as host arrays, plus the
run's config. What the tools used after a run (export_hf, sample) start from.

Nothing here builds a mesh, a model or an optimizer: the `state` item is restored by orbax as NumPy
arrays (a partial restore of θ and, where the outer method keeps them, the slow weights φ; the
optimizer's moments are never read), so a checkpoint of a run that needed many devices is read on a
laptop's CPU, in the layout it was saved in (every leaf stacked over the N replicas; pipeline stages
and fsdp shards are logical [N, ...] arrays on disk, checkpoint/manager.py). The config is the one the
checkpoint's meta item recorded when it was saved (WORKDIR/config.json may have been rewritten by a
later resume), validated by the schema like any config.

Everything read is verified exactly as a resume verifies it (restoring.Restorer._read, with the same
data_item.restore_items and checksum.py): the meta record and every process's data file against their digests,
and the whole state (every leaf, the optimizer's included, read for this) against the checksums stored
at save time. A step that fails is set aside, never used: without `--step` the newest valid step is
read instead and the skipped ones are named (`Snapshot.skipped`, which the tools print as a warning);
a step asked for that fails, or a workdir with no valid step, is one CheckpointReadError. Unlike a
resume, nothing is moved: a reader never changes the workdir (a resumed run quarantines the step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from noloco_jax import config as config_schema
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import data_item
from noloco_jax.outer import consensus as consensus_lib
from noloco_jax.runtime import failures

CHECKPOINT_DIR = "checkpoints"  # the same folder as manager.CHECKPOINT_DIR (not imported: no orbax manager needed)


class CheckpointReadError(ValueError):
  """The workdir, step or checkpoint asked for cannot be read; the message is one line naming it."""


class InvalidStepError(ValueError):
  """One checkpoint step fails what a resume verifies (unreadable, or not what was saved)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """One checkpoint step of a run, on the host.

  params: θ, every leaf [N, ...] (N replicas). slow: φ, the same tree, or None when the outer method
  keeps no slow weights (ddp, none). config: the validated config the checkpoint was saved with.
  """
  workdir: str
  step: int
  config: ml_collections.ConfigDict
  params: Any
  slow: Any | None
  meta: dict
  skipped: tuple[tuple[int, str], ...] = ()  # newer steps that failed verification: (step, why), newest first

  @property
  def num_replicas(self) -> int:
    return int(jax.tree.leaves(self.params)[0].shape[0])

  def replica(self, i: int) -> Any:
    """θ of replica `i` (leaves without the replica axis)."""
    if not 0 <= i < self.num_replicas:
      raise CheckpointReadError(f"--replica={i}: the checkpoint of step {self.step} holds replicas 0 to "
                                f"{self.num_replicas - 1}.")
    return jax.tree.map(lambda x: x[i], self.params)

  def weights(self, replica: int | None = None, *, consensus: bool = False, source: str = "slow") -> Any:
    """One model's weights as host arrays: replica `replica`'s θ, or the consensus model (outer/consensus.py:
    the replica mean of φ, of θ with source="theta" or when the method keeps no φ). Replica 0 by default."""
    if consensus:
      if replica is not None:
        raise CheckpointReadError("--replica and --consensus exclude each other: export one replica or the consensus model.")
      return jax.tree.map(np.asarray, consensus_lib.consensus_params(self.params, self.slow, source))
    return self.replica(0 if replica is None else replica)


def checkpoint_root(workdir: str) -> str:
  """WORKDIR/checkpoints, or a clear error when the path holds no checkpoints folder."""
  root = os.path.join(os.path.abspath(os.path.expanduser(workdir)), CHECKPOINT_DIR)
  if not os.path.isdir(root):
    raise CheckpointReadError(f"WORKDIR={workdir!r} holds no checkpoints/ folder: give the --workdir of a run "
                              "that saved a checkpoint (checkpoint_every, or the end of the run).")
  return root


@contextlib.contextmanager
def _quiet_orbax():
  """orbax warns about every read-only manager it opens (through absl); a reader wants none of that, nor the
  closed-event-loop tracebacks of an abandoned read of a damaged step (the step's warning says what failed)."""
  failures.quiet_orbax_noise()
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def steps(workdir: str) -> list[int]:
  """The committed checkpoint steps of a run, in order (orbax's own list: temporary folders excluded)."""
  root = checkpoint_root(workdir)
  with _quiet_orbax():
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
      return sorted(int(s) for s in manager.all_steps())
    finally:
      manager.close()


def read(workdir: str, step: int | None = None, *, slow: bool = True) -> Snapshot:
  """Step `step` of WORKDIR's checkpoints, verified; without `step` the newest step that verifies (the
  newer ones that do not are in `Snapshot.skipped`). θ always, φ too when `slow`."""
  root = checkpoint_root(workdir)
  available = steps(workdir)
  if not available:
    raise CheckpointReadError(f"WORKDIR={workdir!r}: {root} holds no complete checkpoint.")
  if step is not None:
    if step not in available:
      raise CheckpointReadError(f"--step={step}: not a checkpoint of {workdir!r}; its steps are {available}.")
    try:
      return _read_step(workdir, root, step, slow)
    except InvalidStepError as e:
      raise CheckpointReadError(f"--step={step}: checkpoint step {step} in {root} fails verification ({e}); "
                                "without --step the newest valid step is read.") from None
  skipped = []
  for candidate in reversed(available):
    try:
      return dataclasses.replace(_read_step(workdir, root, candidate, slow), skipped=tuple(skipped))
    except InvalidStepError as e:
      skipped.append((candidate, str(e)))
  raise CheckpointReadError(f"WORKDIR={workdir!r}: no valid checkpoint in {root}: step(s) "
                            f"{', '.join(str(s) for s, _ in skipped)} all fail verification (step {skipped[0][0]}: "
                            f"{skipped[0][1]}).")


def skipped_warning(snap: Snapshot) -> str | None:
  """One line naming the newer steps that failed verification and the step read instead (None: none failed)."""
  if not snap.skipped:
    return None
  bad = "; ".join(f"step {s}: {why}" for s, why in snap.skipped)
  return (f"checkpoint step(s) {', '.join(str(s) for s, _ in snap.skipped)} of {snap.workdir} fail verification "
          f"({bad}); read step {snap.step} instead, the newest valid one (nothing was moved: a resumed run sets "
          "the bad steps aside).")


def _first_line(e: BaseException, limit: int = 240) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= limit else text[:limit - 1] + "…"


def _read_step(workdir: str, root: str, step: int, slow: bool) -> Snapshot:
  """One step, verified as a resume verifies it (InvalidStepError when it fails)."""
  try:
    with _quiet_orbax():
      manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
      try:
        meta, data = data_item.restore_items(manager, step)  # the resume's checks of the JSON items
      finally:
        manager.close()
    with _quiet_orbax():
      state = _read_state(os.path.join(root, str(step), "state"))
    _verify_state(meta, state)
  except Exception as e:  # pylint: disable=broad-except  (any failure to read or verify sets the step aside)
    raise InvalidStepError(_first_line(e)) from e
  config = _config(workdir, meta)
  key = consensus_lib.SLOW_KEY  # where the outer method keeps φ (noloco_jax/outer/methods/), if it keeps one
  outer = state.get("outer")
  phi = outer[key] if slow and isinstance(outer, dict) and key in outer else None
  return Snapshot(workdir=os.path.abspath(workdir), step=int(step), config=config, params=state["params"], slow=phi,
                  meta=meta)
def _config(workdir: str, meta: dict) -> ml_collections.ConfigDict:
  """The checkpoint's config (meta), else WORKDIR/config.json; validated by the schema."""
  saved = meta.get("config")
  if not saved:
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
      raise CheckpointReadError(f"WORKDIR={workdir!r}: neither the checkpoint nor config.json holds the run's config.")
    with open(path) as f:
      saved = json.load(f)
  return config_schema.validate(ml_collections.ConfigDict(saved))


def _read_state(path: str) -> dict:
  """The whole state item as NumPy arrays, in orbax's own tree (dicts and lists: a NamedTuple of the
  optimizer state is a dict of its fields): every leaf, since the checksums cover every leaf."""
  checkpointer = ocp.PyTreeCheckpointer()
  item = checkpointer.metadata(path).item_metadata  # {step, params, opt_state, outer}: shapes, dtypes
  if item is None:  # orbax logs why and returns nothing
    raise ValueError("state/: orbax cannot read the item's tree metadata (a file of the step is damaged or missing)")
  # restore_type=np.ndarray: whole arrays in host memory, no devices, no shardings.
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item.tree)
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item.tree, restore_args=restore_args))


_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]")


def _path_parts(keystr: str) -> tuple[str, ...]:
  """`.opt_state[1][0].mu['embed']['embedding']` (a TrainState path, records.shapes) -> its parts."""
  return tuple(a or b or c for a, b, c in _PATH_PART.findall(keystr))


def _verify_state(meta: dict, state: dict) -> None:
  """Raises unless `state` matches the checksums saved in `meta`: the resume's own check (checksum.verify),
  on the leaves in the order the saved TrainState had them (meta's `state_shapes`, written in that order)."""
  if meta.get("state_checksums") is None:  # written before checksums were stored: nothing to compare
    return
  found = {_path_parts(jax.tree_util.keystr(p)): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  leaves = []
  for key, (shape, dtype) in meta["state_shapes"].items():
    x = found.get(_path_parts(key))
    if x is None or list(np.shape(x)) != list(shape) or np.asarray(x).dtype.name != dtype:
      raise checksum.StateChecksumError(f"state leaf {key}: saved as {shape} {dtype}, read "
                                        f"{None if x is None else (list(np.shape(x)), np.asarray(x).dtype.name)}")
    leaves.append(x)
  if len(leaves) != len(found):
    raise checksum.StateChecksumError(f"the state holds {len(found)} leaves, the meta record lists {len(leaves)}")
  # The resume's function, on one device of this host (the sums do not depend on the layout, checksum.py).
  checksum.verify(meta, leaves, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("replica",)))
