"""Reading one checkpoint step outside a training run: every replica's weights as host arrays, plus the
run's config. What the tools used after a run (export_hf, sample) start from.

Nothing here builds a mesh, a model or an optimizer: the `state` item is restored by orbax as NumPy
arrays (a partial restore of θ and, where the outer method keeps them, the slow weights φ; the
optimizer's moments are never read), so a checkpoint of a run that needed many devices is read on a
laptop's CPU, in the layout it was saved in (every leaf stacked over the N replicas; pipeline stages
and fsdp shards are logical [N, ...] arrays on disk, checkpoint/manager.py). The config is the one the
checkpoint's meta item recorded when it was saved (WORKDIR/config.json may have been rewritten by a
later resume), validated by the schema like any config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from noloco_jax import config as config_schema
from noloco_jax.io.checkpoint import records
from noloco_jax.outer import consensus as consensus_lib

CHECKPOINT_DIR = "checkpoints"  # the same folder as manager.CHECKPOINT_DIR (not imported: no orbax manager needed)


class CheckpointReadError(ValueError):
  """The workdir, step or checkpoint asked for cannot be read; the message is one line naming it."""


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
  """orbax warns about every read-only manager it opens (through absl); a reader wants none of that."""
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
  """Step `step` (default: the latest) of WORKDIR's checkpoints; θ always, φ too when `slow`."""
  root = checkpoint_root(workdir)
  available = steps(workdir)
  if not available:
    raise CheckpointReadError(f"WORKDIR={workdir!r}: {root} holds no complete checkpoint.")
  if step is None:
    step = available[-1]
  elif step not in available:
    raise CheckpointReadError(f"--step={step}: not a checkpoint of {workdir!r}; its steps are {available}.")
  with _quiet_orbax():
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
      manager.close()
  if meta.get("format") != records.FORMAT:
    raise CheckpointReadError(f"checkpoint step {step} in {root}: meta format {meta.get('format')!r}, this "
                              f"code reads {records.FORMAT!r}.")
  config = _config(workdir, meta)
  with _quiet_orbax():
    params, phi = _read_state(os.path.join(root, str(step), "state"), slow)
  return Snapshot(workdir=os.path.abspath(workdir), step=int(step), config=config, params=params, slow=phi, meta=meta)


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


def _read_state(path: str, slow: bool):
  """(θ, φ or None) as NumPy arrays: orbax restores only those subtrees of the state item."""
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree  # {step, params, opt_state, outer}: shapes, dtypes
  item = {"params": tree["params"]}
  key = consensus_lib.SLOW_KEY  # where the outer method keeps φ (noloco_jax/outer/methods/), if it keeps one
  has_slow = isinstance(tree.get("outer"), dict) and key in tree["outer"]
  if slow and has_slow:
    item["outer"] = {key: tree["outer"][key]}
  # restore_type=np.ndarray: whole arrays in host memory, no devices, no shardings.
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  out = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                partial_restore=True))
  return out["params"], (out["outer"][key] if "outer" in item else None)
