"""Config validation, all in one place, run before anything is compiled.

Each failure is a ValueError naming the field, the value and what would be valid. The known fields
and their types are those of configs/default.py; a field this module does not know is an error, so
that a typo (`--config.outer.momentun=0.9`) can never be silently ignored.
"""

from __future__ import annotations

import logging
import os

import ml_collections

from noloco_jax.models import llama as model_lib
from noloco_jax.outer.methods import KINDS, MESSAGE_DTYPES
from noloco_jax.outer import stability
from noloco_jax.outer.pairing import MODES
from noloco_jax.parallel.pipeline import CLIPS
from noloco_jax.parallel.routing import ROUTINGS

_TOP = {"seed", "num_steps", "num_replicas", "num_devices", "fsdp", "eval_every", "log_every", "checkpoint_every",
        "nan_policy", "model", "data", "inner", "outer", "checkpoint", "num_stages", "pipeline"}
_MODEL = {"preset", "d_model", "num_layers", "num_heads", "mlp_dim", "vocab_size", "max_seq_len",
          "rope_theta", "norm_eps", "param_dtype", "dtype", "remat"}
_INNER = {"optimizer", "lr", "warmup_steps", "min_lr_ratio", "b1", "b2", "eps", "weight_decay", "grad_clip",
          "microbatches"}
_OUTER = {"kind", "inner_steps", "group_size", "momentum", "lr", "gamma", "nesterov", "message_dtype",
          "pairing", "state_dtype", "offload", "allow_unstable"}
_CHECKPOINT = {"keep", "warm_start", "async_save"}
_PIPELINE = {"routing", "microbatches", "clip"}
NAN_POLICIES = ("error", "skip_round")
# Sections owned by other modules validate their own keys (data: noloco_jax.io.data.validate).
_SECTIONS = {"": _TOP, "model": _MODEL, "inner": _INNER, "outer": _OUTER, "checkpoint": _CHECKPOINT,
             "pipeline": _PIPELINE}


class ConfigError(ValueError):
  pass


def _fail(field: str, value, valid: str):
  raise ConfigError(f"config.{field}={value!r} is not valid: {valid}.")


def check_known_fields(config: ml_collections.ConfigDict, extra_top: frozenset = frozenset()) -> None:
  for section, known in _SECTIONS.items():
    node = config if not section else config.get(section)
    if node is None:
      raise ConfigError(f"config.{section} is missing: every config needs the sections {sorted(_SECTIONS)[1:]}.")
    known = known | extra_top if not section else known
    for key in node.keys():
      if key not in known:
        prefix = f"{section}." if section else ""
        raise ConfigError(f"config.{prefix}{key} is not a known field; valid fields of config"
                          f"{'.' + section if section else ''}: {sorted(known)}.")


def _positive(config, field: str, allow_zero: bool = False):
  value = config
  for part in field.split("."):
    value = value[part]
  if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
    _fail(field, value, f"an integer {'≥ 0' if allow_zero else '≥ 1'}")


def _validate_pipeline(config: ml_collections.ConfigDict) -> None:
  """num_stages and config.pipeline (pipeline.py, routing.py)."""
  _positive(config, "num_stages")
  p = config.pipeline
  if p.routing not in ROUTINGS:
    _fail("pipeline.routing", p.routing, f"one of {ROUTINGS}")
  if p.clip not in CLIPS:
    _fail("pipeline.clip", p.clip, f"one of {CLIPS}")
  _positive(config, "pipeline.microbatches", allow_zero=True)
  if p.microbatches and config.data.batch_size % p.microbatches:
    _fail("pipeline.microbatches", p.microbatches,
          f"0 (one sequence per micro-batch) or a divisor of data.batch_size={config.data.batch_size}")
  layers = config.model.num_layers or model_lib.PRESETS[config.model.preset]["num_layers"]
  if layers % config.num_stages:
    _fail("num_stages", config.num_stages, f"a divisor of the model's {layers} layers (every stage gets as many)")


def validate(config: ml_collections.ConfigDict, extra_top: frozenset = frozenset()) -> None:
  """Raises ConfigError on the first invalid field, and on an unstable NoLoCo (α, γ) unless allowed."""
  check_known_fields(config, extra_top)
  for field in ("num_steps", "num_replicas"):
    _positive(config, field)
  for field in ("num_devices", "eval_every", "log_every", "checkpoint_every"):
    _positive(config, field, allow_zero=True)
  if config.num_devices and config.num_replicas % config.num_devices:
    _fail("num_devices", config.num_devices,
          f"0 (automatic) or a divisor of num_replicas={config.num_replicas} (each device holds N/D replicas)")
  _positive(config, "fsdp")
  if config.data.batch_size % config.fsdp:
    _fail("fsdp", config.fsdp, f"a divisor of data.batch_size={config.data.batch_size} (each of a replica's fsdp "
          "devices computes batch_size / fsdp sequences)")
  _validate_pipeline(config)
  _positive(config, "inner.microbatches")
  if config.data.batch_size % (config.inner.microbatches * config.fsdp):
    _fail("inner.microbatches", config.inner.microbatches,
          f"a number M with M × fsdp dividing data.batch_size={config.data.batch_size} (fsdp={config.fsdp}): "
          "every micro-batch is split evenly over the replica's fsdp devices")
  if config.inner.microbatches > 1 and config.num_stages > 1:
    _fail("inner.microbatches", config.inner.microbatches,
          "1 with num_stages > 1 (the pipeline cuts the batch itself: pipeline.microbatches)")
  if config.nan_policy not in NAN_POLICIES:
    _fail("nan_policy", config.nan_policy, f"one of {NAN_POLICIES}")

  c = config.checkpoint
  _positive(config, "checkpoint.keep")
  if not isinstance(c.async_save, bool):
    _fail("checkpoint.async_save", c.async_save, "True or False")
  if not isinstance(c.warm_start, str):
    _fail("checkpoint.warm_start", c.warm_start, "a path string ('' = none)")
  if c.warm_start and not os.path.isdir(os.path.expanduser(c.warm_start)):
    _fail("checkpoint.warm_start", c.warm_start,
          "'' or an existing directory: a run's workdir, its checkpoints directory or one step directory")

  m = config.model
  if m.preset not in model_lib.PRESETS:
    _fail("model.preset", m.preset, f"one of {sorted(model_lib.PRESETS)}")
  for field in ("d_model", "num_layers", "num_heads", "mlp_dim", "vocab_size", "max_seq_len"):
    _positive(config, f"model.{field}", allow_zero=True)
  for field in ("dtype", "param_dtype"):
    if m[field] not in model_lib.DTYPES:
      _fail(f"model.{field}", m[field], f"one of {sorted(model_lib.DTYPES)}")
  d_model = m.d_model or model_lib.PRESETS[m.preset]["d_model"]
  heads = m.num_heads or model_lib.PRESETS[m.preset]["num_heads"]
  if d_model % heads or (d_model // heads) % 2:
    _fail("model.num_heads", heads, f"a divisor of d_model={d_model} leaving an even head dimension (for RoPE)")
  for field in ("rope_theta", "norm_eps"):
    if not m[field] > 0:
      _fail(f"model.{field}", m[field], "a number > 0")
  if m.max_seq_len and m.max_seq_len < config.data.seq_len:
    _fail("data.seq_len", config.data.seq_len, f"at most model.max_seq_len={m.max_seq_len}")

  i = config.inner
  if i.optimizer not in ("adam", "adamw"):
    _fail("inner.optimizer", i.optimizer, "'adam' or 'adamw'")
  if not i.lr > 0:
    _fail("inner.lr", i.lr, "a number > 0")
  _positive(config, "inner.warmup_steps", allow_zero=True)
  if not 0 <= i.min_lr_ratio <= 1:
    _fail("inner.min_lr_ratio", i.min_lr_ratio, "a number in [0, 1]")
  for field in ("b1", "b2"):
    if not 0 <= i[field] < 1:
      _fail(f"inner.{field}", i[field], "a number in [0, 1)")
  if i.grad_clip < 0:
    _fail("inner.grad_clip", i.grad_clip, "a number ≥ 0 (0 disables clipping)")
  if not i.eps > 0:
    _fail("inner.eps", i.eps, "a number > 0")
  if i.weight_decay < 0:
    _fail("inner.weight_decay", i.weight_decay, "a number ≥ 0")

  o = config.outer
  if o.kind not in KINDS:
    _fail("outer.kind", o.kind, f"one of {KINDS}")
  _positive(config, "outer.inner_steps")
  if o.message_dtype not in MESSAGE_DTYPES:
    _fail("outer.message_dtype", o.message_dtype, f"one of {sorted(MESSAGE_DTYPES)}")
  if o.pairing not in MODES:
    _fail("outer.pairing", o.pairing, f"one of {MODES}")
  if o.state_dtype not in ("",) + tuple(model_lib.DTYPES):
    _fail("outer.state_dtype", o.state_dtype, f"'' (the parameters' dtype) or one of {sorted(model_lib.DTYPES)}")
  if not isinstance(o.offload, bool):
    _fail("outer.offload", o.offload, "True or False")
  if not isinstance(m.remat, bool):
    _fail("model.remat", m.remat, "True or False")
  if not isinstance(o.nesterov, bool):
    _fail("outer.nesterov", o.nesterov, "True or False")
  if config.nan_policy == "skip_round" and config.checkpoint_every % o.inner_steps:
    _fail("checkpoint_every", config.checkpoint_every,
          f"a multiple of outer.inner_steps={o.inner_steps} with nan_policy='skip_round' (saves then fall at "
          "round ends, after the round has been checked)")
  if not 0 <= o.momentum < 1:
    _fail("outer.momentum", o.momentum, "a number in [0, 1)")
  if not o.lr > 0:
    _fail("outer.lr", o.lr, "a number > 0")
  if o.kind in ("noloco", "gossip"):
    if not isinstance(o.group_size, int) or o.group_size < 2:
      _fail("outer.group_size", o.group_size, "an integer ≥ 2 (a group averages at least two replicas)")
    if config.num_replicas % o.group_size:
      _fail("outer.group_size", o.group_size,
            f"a divisor of num_replicas={config.num_replicas} (the replicas are cut into equal groups)")
  if o.kind == "noloco":
    if o.gamma <= 0:
      _fail("outer.gamma", o.gamma, "a number > 0")
    if not isinstance(o.allow_unstable, bool):
      _fail("outer.allow_unstable", o.allow_unstable, "True or False")
    # The exact mean-square stability of the spread for this update (outer/stability.py), not the
    # paper's interval, which is accurate only near α ≈ 0.5.
    problem = stability.instability(o.momentum, o.gamma, o.group_size, config.num_replicas)
    if problem and not o.allow_unstable:
      raise ConfigError(f"config.outer.gamma={o.gamma!r} is not valid: {problem}. Lower γ or α, or set "
                        "outer.allow_unstable=True to run it anyway.")
    if problem:
      logging.warning("outer.allow_unstable=True: %s.", problem)
    if o.pairing == "round_robin" and o.group_size != 2:
      _fail("outer.pairing", o.pairing, f"'fresh' or 'fixed' with group_size={o.group_size} ('round_robin' pairs "
            "replicas: group_size 2 only)")
