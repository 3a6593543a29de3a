"""Config validation: every constrained field fails before anything is compiled, naming field and value.

`train.build` is the one entry point that runs all the checks (config.validate, then the data
section's own validation, then the mesh's device count); it compiles nothing, so each case costs
milliseconds.
"""

import logging

import ml_collections
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.training import loop as train

# (dotted field, bad value, words the message must hold besides "field=value").
BAD_VALUES = [
    # Top level.
    ("num_steps", 0, "≥ 1"),
    ("num_replicas", 0, "≥ 1"),
    ("num_devices", -1, "≥ 0"),
    ("num_devices", 3, "divisor of num_replicas=8"),  # replicas vs devices
    ("eval_every", -1, "≥ 0"),
    ("log_every", -1, "≥ 0"),
    ("checkpoint_every", -1, "≥ 0"),
    ("nan_policy", "ignore", "skip_round"),
    ("fsdp", 0, "≥ 1"),
    ("fsdp", 3, "divisor of data.batch_size=2"),
    ("num_stages", 0, "≥ 1"),
    ("num_stages", 2, "divisor of the model's 1 layers"),
    ("checkpoint.keep", 0, "≥ 1"),
    ("checkpoint.warm_start", "/nonexistent/run", "existing directory"),
    # Model.
    ("model.preset", "huge", "tiny"),
    ("model.d_model", -1, "≥ 0"),
    ("model.num_layers", -1, "≥ 0"),
    ("model.num_heads", 3, "divisor of d_model=32"),
    ("model.mlp_dim", -1, "≥ 0"),
    ("model.vocab_size", -1, "≥ 0"),
    ("model.max_seq_len", -1, "≥ 0"),
    ("model.dtype", "float16", "bfloat16"),
    ("model.param_dtype", "int8", "float32"),
    ("model.rope_theta", 0.0, "> 0"),
    ("model.norm_eps", 0.0, "> 0"),
    # Inner optimizer.
    ("inner.optimizer", "sgd", "adamw"),
    ("inner.lr", 0.0, "> 0"),
    ("inner.warmup_steps", -1, "≥ 0"),
    ("inner.min_lr_ratio", 1.5, "[0, 1]"),
    ("inner.b1", 1.0, "[0, 1)"),
    ("inner.b2", -0.1, "[0, 1)"),
    ("inner.eps", 0.0, "> 0"),
    ("inner.weight_decay", -0.1, "≥ 0"),
    ("inner.grad_clip", -1.0, "≥ 0"),
    ("inner.microbatches", 0, "≥ 1"),
    ("inner.microbatches", 3, "dividing data.batch_size=2"),
    # Outer step.
    ("outer.kind", "fedavg", "noloco"),
    ("outer.inner_steps", 0, "≥ 1"),  # H < 1
    ("outer.group_size", 1, "≥ 2"),  # n < 2
    ("outer.group_size", 3, "divisor of num_replicas=8"),
    ("outer.momentum", 1.0, "[0, 1)"),
    ("outer.momentum", -0.1, "[0, 1)"),
    ("outer.lr", 0.0, "> 0"),
    ("outer.gamma", 0.0, "> 0"),
    ("outer.message_dtype", "int8", "bfloat16"),
    ("outer.pairing", "random", "fresh"),
    ("outer.state_dtype", "float16", "bfloat16"),
    # Pipeline stages.
    ("pipeline.routing", "x", "random"),
    ("pipeline.clip", "x", "per_stage"),
    ("pipeline.microbatches", -1, "≥ 0"),
    ("pipeline.microbatches", 3, "divisor of data.batch_size=2"),
    # Data (validated by noloco_jax.io.data, called from build before anything is compiled).
    ("data.seq_len", 0, ">= 1"),
    ("data.batch_size", 0, ">= 1"),
    ("data.eval_batches", -1, ">= 0"),
    ("data.prefetch", -1, ">= 0"),
    ("data.shuffle_buffer", 0, ">= 1"),
    ("data.source", "nope", "stdlib"),
    ("data.tokenizer", "nope", "bytes"),
    ("data.mode", "x", "stream"),
    ("data.shard_by", "x", "document"),
]


def smoke() -> ml_collections.ConfigDict:
  return default.get_config("smoke")


def set_field(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def build_error(config) -> str:
  with pytest.raises(ValueError) as info:
    train.build(config)
  return str(info.value)


def test_the_default_and_smoke_configs_are_valid():
  config_lib.validate(default.get_config())
  train.build(smoke())


@pytest.mark.parametrize("field,value,valid", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_a_bad_value_names_field_value_and_what_is_valid(field, value, valid):
  config = smoke()
  set_field(config, field, value)
  message = build_error(config)
  assert f"{field.split('.')[-1]}={value!r}" in message, message
  assert valid in message, message


@pytest.mark.parametrize("section", ["", "model", "inner", "outer", "checkpoint", "pipeline", "data"])
def test_an_unknown_field_at_any_level_is_an_error(section):
  config = smoke()
  node = config[section] if section else config
  node.momentun = 0.9  # a typo must never be silently ignored
  message = build_error(config)
  assert "momentun" in message and "valid" in message, message


def test_more_devices_than_exist_is_an_error():
  config = smoke()  # checked by the mesh, which sees the devices; still before anything is compiled
  config.num_replicas, config.num_devices = 16, 16
  message = build_error(config)
  assert "num_devices=16" in message and "only 8 devices" in message, message


def test_a_missing_section_is_an_error():
  config = smoke()
  del config["checkpoint"]
  assert "config.checkpoint is missing" in build_error(config)


def test_a_model_vocabulary_smaller_than_the_tokenizer_s():
  config = smoke()
  config.model.vocab_size = 100  # the byte tokenizer has 257 ids
  message = build_error(config)
  assert "vocab_size 100" in message and ">= 257" in message, message


def test_data_seq_len_longer_than_the_model_allows():
  config = smoke()
  config.model.max_seq_len = 16
  message = build_error(config)
  assert "data.seq_len=32" in message and "max_seq_len=16" in message, message


@pytest.mark.parametrize("fields,named", [
    ({"data.source": "c4_json", "data.path": "/nonexistent/c4"}, "path='/nonexistent/c4'"),
    ({"data.source": "text", "data.train_files": "/nonexistent/*.txt", "data.eval_files": "/nonexistent/*.txt"},
     "train_files='/nonexistent/*.txt'"),
    ({"data.source": "tfds", "data.tfds_name": ""}, "tfds_name=''"),
    ({"data.tokenizer": "sentencepiece", "data.spm_model": "/nonexistent.model"}, "spm_model='/nonexistent.model'"),
])
def test_a_missing_dataset_or_tokenizer_path_is_named(fields, named):
  config = smoke()
  for field, value in fields.items():
    set_field(config, field, value)
  message = build_error(config)
  assert named in message, message


def test_skip_round_needs_checkpoints_at_round_ends():
  config = smoke()  # H = 3
  config.nan_policy = "skip_round"
  config.checkpoint_every = 4
  message = build_error(config)
  assert "checkpoint_every=4" in message and "outer.inner_steps=3" in message, message
  config.checkpoint_every = 6
  config_lib.validate(config)


def test_an_unstable_gamma_is_refused_unless_allowed(caplog):
  """The issue's examples: α = 0.9, γ = 1.2 (inside the paper's interval) diverges; γ = 0.3 is fine."""
  config = smoke()
  config.outer.momentum, config.outer.gamma = 0.9, 0.3  # outside the paper's interval, stable
  with caplog.at_level(logging.WARNING):
    config_lib.validate(config)
  assert not [r for r in caplog.records if "unstable" in r.getMessage()]
  config.outer.gamma = 1.2
  with pytest.raises(config_lib.ConfigError, match=r"outer.gamma=1.2 .*grows by 11.4% per round") as error:
    config_lib.validate(config)
  assert "outer.allow_unstable=True" in str(error.value) and "\n" not in str(error.value)
  config.outer.allow_unstable = True
  with caplog.at_level(logging.WARNING):
    config_lib.validate(config)
  warnings = [r.getMessage() for r in caplog.records if "unstable" in r.getMessage()]
  assert len(warnings) == 1 and "11.4% per round" in warnings[0], warnings


def test_round_robin_needs_pairs():
  config = smoke()
  config.outer.pairing, config.outer.group_size = "round_robin", 4
  with pytest.raises(config_lib.ConfigError, match="outer.pairing='round_robin'.*group_size 2 only"):
    config_lib.validate(config)
