"""`config.data` checked against the file system and the tokenizer, before anything is compiled.

The record itself, its defaults, field comments and the checks the fields alone decide live in the
config schema (noloco_jax/config/data.py: DataSpec); everything in this package reads a DataSpec,
never the ConfigDict.
"""

import os

from noloco_jax.config import ConfigError
from noloco_jax.config.data import DataSpec
from noloco_jax.config.fields import fail
from noloco_jax.io.data import documents
from noloco_jax.io.data import tokenizer as tokenizer_lib

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "noloco_jax", "tensorflow_datasets")

__all__ = ["DEFAULT_DATA_DIR", "DataSpec", "check_against_model", "check_source_paths", "resolve_data_dir", "to_spec", "validate",
           "validate_with_tokenizer", "validate_workers"]


def resolve_data_dir(data_dir: str) -> str:
  """`config.data.data_dir`, with "" meaning the per-user default cache."""
  return os.path.abspath(os.path.expanduser(data_dir or DEFAULT_DATA_DIR))


def to_spec(config_data) -> DataSpec:
  """A checked DataSpec from a ConfigDict, dict or DataSpec; a bad or unknown field is a ConfigError."""
  return DataSpec.parse(config_data)


def validate(config_data, model_max_seq_len: int = 0, vocab_size: int = 0) -> DataSpec:
  """Checks `config.data` before anything is compiled; raises ConfigError naming field, value and
  what is valid. `model_max_seq_len` / `vocab_size` of 0 skip the checks against the model.

  Cheap: it opens the tokenizer (to compare vocabularies) and checks paths exist, but reads no data.
  """
  return validate_with_tokenizer(config_data, model_max_seq_len, vocab_size)[0]


def validate_with_tokenizer(config_data, model_max_seq_len: int = 0, vocab_size: int = 0):
  """`validate`, also returning the tokenizer it opened (so callers need not load it twice)."""
  spec = to_spec(config_data)
  _check_paths(spec)
  tok = tokenizer_lib.make_tokenizer(spec)  # Raises for a missing model file or a bad eos_id.
  check_against_model(spec, tok, model_max_seq_len, vocab_size)
  return spec, tok


def check_against_model(spec: DataSpec, tok, model_max_seq_len: int = 0, vocab_size: int = 0) -> None:
  """The sequence length and the tokenizer's vocabulary fit the model (0: not checked); ConfigError."""
  if model_max_seq_len and spec.seq_len > model_max_seq_len:
    fail("data.seq_len", spec.seq_len, f"at most the model's max_seq_len, {model_max_seq_len}")
  if vocab_size and tok.vocab_size > vocab_size:
    raise ConfigError(f"config.data.tokenizer={spec.tokenizer!r} has vocab_size {tok.vocab_size}, "
                      f"more than the model's vocab_size {vocab_size}; valid: a model vocab_size >= "
                      f"{tok.vocab_size} (config.model.vocab_size = 0 takes the tokenizer's).")


def validate_workers(spec: DataSpec, mode: str) -> None:
  """A packed stream is sequential: one worker process per replica at most (see iterator.py)."""
  if mode == "stream" and spec.workers > 1:
    fail("data.workers", spec.workers, "0 or 1 in stream mode (a replica's packed stream is read by "
         "one process); any count >= 0 in array mode")


def check_source_paths(config_data) -> DataSpec:
  """The source's own paths exist (not the tokenizer's: train_spm checks this before it makes one);
  ConfigError naming the field otherwise. Returns the DataSpec."""
  spec = to_spec(config_data)
  if spec.source == "c4_json":
    if not spec.path or not os.path.isdir(os.path.expanduser(spec.path)):
      fail("data.path", spec.path, "an existing directory holding c4-train.*.json.gz files")
  if spec.source in ("parquet", "text"):
    for name in ("train_files", "eval_files"):
      documents.expand_globs(spec[name], name)  # Raises naming the pattern that matches nothing.
  if spec.source == "tfds" and not spec.tfds_name:
    fail("data.tfds_name", spec.tfds_name, "a TFDS dataset name such as 'c4/en'")
  return spec


def _check_paths(spec: DataSpec) -> None:
  check_source_paths(spec)  # the source first: a run missing both names the data before the tokenizer
  if spec.tokenizer == "sentencepiece" and not os.path.isfile(os.path.expanduser(spec.spm_model)):
    fail("data.spm_model", spec.spm_model, "the path of an existing SentencePiece .model file")
