"""Default job: 8 replicas of a tiny Llama trained with NoLoCo on the embedded standard-library corpus.

Run (on a laptop CPU; 8 fake CPU devices are created when there are fewer real ones):

    python -m noloco_jax.main --config=configs/default.py --workdir=runs/default

Expected: finishes in a few minutes on 2 CPU cores; validation loss falls from ~5.6 (uniform over
257 byte tokens) to below ~2.5 nats (see README.md for the measured figure).

Shrink to seconds for a smoke test with the argument string `smoke`:

    python -m noloco_jax.main --config=configs/default.py:smoke --workdir=runs/smoke

Every field can be overridden on the command line, e.g. `--config.outer.kind=diloco`, which trains at
DiLoCo's paper values (α=0.3, β=0.7, H=100) unless those fields are set too: the per-kind outer fields
are left unset here and take the chosen kind's values when the config is validated. The fields, their
defaults and what they mean are in noloco_jax/config/ (one module per section; config.outer in the
sections rule, codec, overlap and asynchronous). Renamed fields keep their old names with a warning: the
flat outer fields (outer.compression is outer.codec.compression, outer.overlap_steps is
outer.overlap.steps, ...) and outer.momentum / lr / gamma (outer.rule.outer_momentum / outer_lr /
consensus_weight: α, β, γ).
"""

import ml_collections

from noloco_jax import config as schema


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Every field at its default. Each field's meaning, default and valid values are written beside it
  # in the schema, one module per section: noloco_jax/config/run.py (top level: seed, num_steps,
  # num_replicas, num_devices, fsdp, num_stages, eval_every, log_every, checkpoint_every, log_barrier,
  # nan_policy, nan_max_skipped_rounds),
  # model.py, data.py, inner.py, outer.py, checkpoint.py and pipeline.py. The defaults are this job:
  # 8 replicas of the tiny Llama, NoLoCo with α=0.5, β=γ=0.7, n=2, H=50 (its paper values, resolved from
  # the unset per-kind fields by its spec: noloco_jax/outer/methods/noloco.py), on the embedded corpus.
  config = schema.default_config_dict()
  if arg:
    _apply_arg(config, arg)
  return config


def _apply_arg(config: ml_collections.ConfigDict, arg: str) -> None:
  """`smoke` shrinks the job to seconds; `model=NAME` selects a model preset."""
  for part in arg.split(","):
    key, _, value = part.partition("=")
    if key == "smoke":
      config.num_steps = 12
      config.eval_every = 6
      config.log_every = 3
      config.outer.inner_steps = 3
      config.inner.warmup_steps = 2
      config.data.seq_len = 32
      config.data.batch_size = 2
      config.data.eval_batches = 1
      config.model.d_model = 32
      config.model.num_layers = 1
      config.model.num_heads = 2
      config.model.mlp_dim = 64
    elif key == "model":
      config.model.preset = value
    else:
      raise ValueError(f"configs/default.py: unknown argument {part!r}; valid: 'smoke', 'model=NAME'.")
