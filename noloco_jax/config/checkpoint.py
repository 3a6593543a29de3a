"""`config.checkpoint`: orbax checkpoints in WORKDIR/checkpoints (noloco_jax/io/checkpoint/).

A run resumes from the latest checkpoint of its own workdir; else it starts from warm_start; else from
scratch. When to save is the top-level `checkpoint_every`.
"""

import dataclasses
import os

from noloco_jax.config.fields import Section, at_least, fail


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  PATH = "checkpoint"

  keep: int = 3  # Most recent checkpoints kept; >= 2 leaves a fallback if the latest is unreadable.
  # Another run's workdir, checkpoints directory or step directory: start from its weights θ (fresh
  # optimizer, φ = θ, δ = 0, step 0). "" = none. Ignored when the workdir holds a checkpoint.
  warm_start: str = ""
  async_save: bool = True  # Write in a background thread; training goes on meanwhile.

  def check(self) -> None:
    at_least("checkpoint.keep", self.keep, 1)
    if self.warm_start and not os.path.isdir(os.path.expanduser(self.warm_start)):
      fail("checkpoint.warm_start", self.warm_start,
           "'' or an existing directory: a run's workdir, its checkpoints directory or one step directory")
