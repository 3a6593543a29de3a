"""`config.pipeline`: pipeline stages within a replica (noloco_jax/parallel/pipeline.py and routing.py).

The number of stages S is the top-level `num_stages`; this section says how micro-batches move.
"""

import dataclasses

from noloco_jax.config.fields import Section, at_least, one_of

ROUTINGS = ("fixed", "random")
CLIPS = ("per_stage", "global")


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Section):
  PATH = "pipeline"

  # Where stage s sends a micro-batch: "random" = stage s+1 of a random replica, drawn per micro-batch and
  # boundary with every destination equally likely (NoLoCo's implicit mixing; parallel/routing.py);
  # "fixed" = its own replica. Eval always uses fixed.
  routing: str = "random"
  microbatches: int = 0  # M micro-batches per step (must divide data.batch_size); 0 = one sequence each.
  clip: str = "per_stage"  # inner.grad_clip per stage (reference) | "global" (whole replica, as without stages).

  def check(self) -> None:
    one_of("pipeline.routing", self.routing, ROUTINGS)
    one_of("pipeline.clip", self.clip, CLIPS)
    at_least("pipeline.microbatches", self.microbatches, 0)
