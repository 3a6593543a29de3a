"""What the checkpointer knows of the run it saves and resumes: its section of the config, and plain values.

Set-up (training/run.py `checkpoint_info`) makes one `RunInfo` from the config and the Setup; nothing in
io/checkpoint receives the Config or the Setup. The config itself reaches the checkpointer only as
data, `config_record` (config.to_dict(), made once): every step's meta item records it whole (the tools
read a run's config from it, read.py), and a resume compares it, field by field, with the record a
checkpoint holds (compatibility.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from noloco_jax.config.checkpoint import CheckpointConfig


@dataclasses.dataclass(frozen=True)
class RunInfo:
  checkpoint: CheckpointConfig  # config.checkpoint: keep, async_save, warm_start, elastic, elastic_replicas
  config_record: dict  # config.to_dict(): saved in each step's meta, compared on resume; never read field by field
  num_steps: int  # the last step: always saved
  checkpoint_every: int  # a save every this many steps (0: only the last)
  nan_policy: str  # "error": the losses not yet logged are checked before a save
  num_replicas: int
  seed: int  # the elastic plan's draws (resize.py)
  log_every: int  # what the logs hold up to a step (log_repair.py), where a checkpoint's config lacks it
  inner_steps: int  # H, likewise
  batch_size: int  # sequences per replica per step: the elastic resume's data note
  num_params: int  # the model's: a training row's `num_params` (log_repair.py)
  mesh: Any  # jax.sharding.Mesh: the NaN checks and the state's checksums, replica by replica
  schedule: Any  # the pairing schedule (outer/pairing.py), None without rounds: recorded with each step
  state_shardings: Any  # where the state lives: a resized state is placed there
  method: Any  # outer_base.OuterMethod: its kind (recorded, compared), `init` (warm start), `new_replica` (grow)
