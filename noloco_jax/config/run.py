"""The top level of the config: the run (seed, length, layout over devices, logging) and its sections."""

import dataclasses

from noloco_jax.config.checkpoint import CheckpointConfig
from noloco_jax.config.data import DataSpec
from noloco_jax.config.fields import ConfigError, Section, at_least, fail, one_of
from noloco_jax.config.inner import InnerConfig
from noloco_jax.config.model import ModelConfig
from noloco_jax.config.outer import OuterConfig
from noloco_jax.config.pipeline import PipelineConfig
from noloco_jax.config.wandb import WandbConfig

NAN_POLICIES = ("error", "skip_round")
CONSENSUS_SOURCES = ("", "slow", "theta")  # outer/consensus.py: SOURCES, or "" for none


def parse_steps(value: str, num_steps: int | None = None) -> tuple[int, int] | None:
  """config.profile_steps: "a,b" (or "a") -> (a, b); "" -> None. One clear line for anything else."""
  value = str(value).strip()
  if not value:
    return None
  try:
    steps = [int(p.strip()) for p in value.split(",")]
  except ValueError:
    steps = []
  if len(steps) == 1:
    steps = steps * 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1] or (num_steps is not None and steps[1] > num_steps):
    bound = f" <= num_steps={num_steps}" if num_steps is not None else ""
    raise ConfigError(f"profile_steps={value!r}: give 'FIRST,LAST' (or one step), inner steps with "
                      f"1 <= FIRST <= LAST{bound}, e.g. '10,12'.")
  return steps[0], steps[1]


def _section(kind):
  return dataclasses.field(default_factory=kind)


@dataclasses.dataclass(frozen=True)
class Config(Section):
  seed: int = 0  # One seed for everything: initial weights, data order, pairings and routes.
  num_steps: int = 500  # Inner steps per replica in total.
  num_replicas: int = 8  # N: model replicas (data parallel). Stacked on the `replica` mesh axis.
  # Devices the replicas are spread over; 0 = as many as divide num_replicas (up to all devices).
  # 1 runs the single-device simulator: all replicas on one device, exchange by gather.
  num_devices: int = 0
  # Devices per replica group (the `fsdp` mesh axis): a replica's θ, Adam moments, φ and δ are split
  # over them leaf by leaf, and its batch_size sequences too (noloco_jax/parallel/sharding.py). The job
  # uses num_devices × num_stages × fsdp devices; fsdp must divide each process's devices and data.batch_size.
  fsdp: int = 1
  # S: pipeline stages per replica (the `stage` mesh axis; config.pipeline says how micro-batches move).
  # Layers are split evenly (num_layers % S == 0); the embedding runs on the first stage, the head on the last.
  num_stages: int = 1
  eval_every: int = 100  # Steps between evaluations (validation loss/ppl, weight std). 0 = only at the end.
  log_every: int = 25  # Steps between training-metric logs (host fetches only at these steps).
  checkpoint_every: int = 0  # Steps between checkpoints; 0 = only at the end.
  # Multi-process jobs only (one process has no cross-process collective to avoid). False: no step
  # between evaluations waits for another process except through the outer round itself: each
  # process logs its own replicas' training rows (workdir/metrics/process_<i>.jsonl, NaN check on
  # its own losses) and process 0 merges the rows that have arrived into metrics.jsonl; SIGTERM is
  # agreed at evaluation steps; the per-round weight std is left out of training rows (it stays in
  # every evaluation). The only job-wide barriers are then evaluations (eval_every), checkpoints
  # (checkpoint_every) and nan_policy="skip_round"'s per-round check. True: every log step gathers
  # every replica's metrics (a barrier over all processes every log_every steps), as before.
  log_barrier: bool = False
  # What a non-finite (NaN/Inf) training loss does: "error" stops the run naming the step and the
  # replica (the last good checkpoint stays as it was); "skip_round" undoes the round it happened in
  # and goes on (see noloco_jax/io/checkpoint/guard.py: RoundGuard).
  nan_policy: str = "error"
  # With "skip_round": how many rounds in a row may be undone before the run stops with an error
  # (a run whose every round diverges is not training). Skipped rounds are counted in the train rows
  # of metrics.jsonl (outer/skipped_rounds) and in the summary.
  nan_max_skipped_rounds: int = 3
  # The consensus model (the mean of the replicas; noloco_jax/outer/consensus.py) is scored on the
  # validation set at every evaluation, beside the replicas' mean loss: eval/consensus_loss and
  # eval/consensus_ppl. "slow" averages φ (θ for methods without φ), "theta" averages θ, "" turns it off.
  eval_consensus: str = "slow"
  # "FIRST,LAST" (or one step): a jax.profiler trace of those inner steps into WORKDIR/profile (for
  # TensorBoard's profile plugin and Perfetto; docs/after_a_run.md, "Profiler"); include a multiple of
  # outer.inner_steps to capture an outer round. "" = no trace.
  profile_steps: str = ""

  checkpoint: CheckpointConfig = _section(CheckpointConfig)  # noloco_jax/config/checkpoint.py
  model: ModelConfig = _section(ModelConfig)  # noloco_jax/config/model.py
  data: DataSpec = _section(DataSpec)  # noloco_jax/config/data.py
  inner: InnerConfig = _section(InnerConfig)  # noloco_jax/config/inner.py
  outer: OuterConfig = _section(OuterConfig)  # noloco_jax/config/outer.py
  pipeline: PipelineConfig = _section(PipelineConfig)  # noloco_jax/config/pipeline.py
  wandb: WandbConfig = _section(WandbConfig)  # noloco_jax/config/wandb.py (an optional experiment tracker)

  def check(self) -> None:
    """The top-level fields alone (the sections have checked themselves when they were parsed)."""
    for name in ("num_steps", "num_replicas", "fsdp", "num_stages", "nan_max_skipped_rounds"):
      at_least(name, getattr(self, name), 1)
    for name in ("num_devices", "eval_every", "log_every", "checkpoint_every"):
      at_least(name, getattr(self, name), 0)
    if self.num_devices and self.num_replicas % self.num_devices:
      fail("num_devices", self.num_devices,
           f"0 (automatic) or a divisor of num_replicas={self.num_replicas} (each device holds N/D replicas)")
    one_of("nan_policy", self.nan_policy, NAN_POLICIES)
    one_of("eval_consensus", self.eval_consensus, CONSENSUS_SOURCES)
    try:
      parse_steps(self.profile_steps, self.num_steps)
    except ConfigError as e:
      fail("profile_steps", self.profile_steps, str(e).split(": ", 1)[1].rstrip("."))
