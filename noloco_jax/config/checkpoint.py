"""`config.checkpoint`: orbax checkpoints in WORKDIR/checkpoints (noloco_jax/io/checkpoint/).

A run resumes from the latest checkpoint of its own workdir; else it starts from warm_start; else from
scratch. When to save is the top-level `checkpoint_every`. `elastic` lets a resume change the replica
count (docs/elastic.md; noloco_jax/io/checkpoint/resize.py).
"""

import dataclasses
import os

from noloco_jax.config.fields import Section, at_least, fail, one_of

ELASTIC_MODES = ("", "drop", "recreate", "grow")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  PATH = "checkpoint"

  keep: int = 3  # Most recent checkpoints kept; >= 2 leaves a fallback if the latest is unreadable.
  # Another run's workdir, checkpoints directory or step directory: start from its weights θ (fresh
  # optimizer, φ = θ, δ = 0, step 0). "" = none. Ignored when the workdir holds a checkpoint.
  warm_start: str = ""
  async_save: bool = True  # Write in a background thread; training goes on meanwhile.
  # Resuming a checkpoint with another set of replicas (docs/elastic.md). "" = the checkpoint's replica
  # count is required. "drop": fewer replicas, the lost ones dropped; "recreate": the same count, the
  # lost ones re-created as copies of their last surviving partner; "grow": more replicas, each new one
  # starting from a seeded peer's slow weights φ. Applied once, to a checkpoint saved without it.
  elastic: str = ""
  # The lost replicas (ids in the checkpoint) that "drop" drops and "recreate" re-creates, e.g. "4,5".
  # "" = the replicas held by the processes the job no longer has (saved process index ≥ process count).
  elastic_replicas: str = ""

  def check(self) -> None:
    at_least("checkpoint.keep", self.keep, 1)
    one_of("checkpoint.elastic", self.elastic, ELASTIC_MODES)
    parse_replica_list(self.elastic_replicas)
    if self.elastic_replicas and self.elastic not in ("drop", "recreate"):
      fail("checkpoint.elastic_replicas", self.elastic_replicas,
           f"'' unless checkpoint.elastic is 'drop' or 'recreate' (it is {self.elastic!r})")
    if self.warm_start and not os.path.isdir(os.path.expanduser(self.warm_start)):
      fail("checkpoint.warm_start", self.warm_start,
           "'' or an existing directory: a run's workdir, its checkpoints directory or one step directory")


def parse_replica_list(text: str) -> list[int]:
  """"4,5,6" -> [4, 5, 6] (checkpoint.elastic_replicas); distinct integers ≥ 0, else a ConfigError."""
  out = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    if not part.isdigit() or int(part) in out:
      fail("checkpoint.elastic_replicas", text, "distinct replica ids ≥ 0 separated by commas, e.g. '4,5'")
    out.append(int(part))
  return out
