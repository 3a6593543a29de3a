"""`config.wandb`: an optional Weights & Biases writer beside metrics.jsonl and TensorBoard (io/writers.py).

Off unless `project` is set. Then process 0 logs the resolved config, every scalar row the run writes
(the same names and steps as metrics.jsonl) and the end-of-run summary to one W&B run. Where it sends
them: `mode` "auto" is online when the WANDB_API_KEY environment variable is set and offline
otherwise (files under WORKDIR/wandb, uploaded later with `wandb sync WORKDIR/wandb/offline-run-*`),
so a run on a machine without credentials or network still works. The key is read from the
environment only, never from a config (configs are logged and checkpointed).
"""

import dataclasses
import importlib.util

from noloco_jax.config.fields import Section, fail, one_of

MODES = ("auto", "online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbConfig(Section):
  PATH = "wandb"

  project: str = ""  # The W&B project; "" = no W&B writer (needs `pip install '.[wandb]'`).
  entity: str = ""  # Team or user; "" = the account's default.
  name: str = ""  # Run name; "" = the workdir's folder name.
  group: str = ""  # Groups runs in the W&B interface (e.g. one sweep); "" = none.
  tags: str = ""  # Comma-separated tags, e.g. "noloco,tiny".
  # auto: online with WANDB_API_KEY in the environment, else offline | online | offline | disabled.
  mode: str = "auto"

  def check(self) -> None:
    one_of("wandb.mode", self.mode, MODES)
    if self.project and self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
      fail("wandb.project", self.project, "'' unless the wandb package is installed (pip install '.[wandb]')")
