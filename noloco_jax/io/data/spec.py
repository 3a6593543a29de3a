"""`config.data` as a typed, fully defaulted record, and `validate` for it.

Everything in the package reads a `DataSpec`, never the ConfigDict, so a config written before a
field existed still works (the field takes its default here) and a misspelt field is an error.
The field comments live in configs/default.py.
"""

import dataclasses
import os

from noloco_jax.io.data import sources
from noloco_jax.io.data import tokenizer as tokenizer_lib

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "noloco_jax", "tensorflow_datasets")
MODES = ("", "array", "stream")
SHARD_BY = ("auto", "file", "document")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  source: str = "stdlib"
  tokenizer: str = "bytes"
  seq_len: int = 128
  batch_size: int = 4
  eval_batches: int = 4
  data_dir: str = ""
  prefetch: int = 2
  workers: int = 0
  mode: str = ""
  shard_by: str = "auto"
  shuffle_buffer: int = 256
  train_split: str = "train"
  eval_split: str = "validation"
  tfds_name: str = ""
  text_field: str = "text"
  path: str = ""
  train_files: str = ""
  eval_files: str = ""
  parquet_ids_field: str = "input_ids"
  parquet_mask_field: str = "attention_mask"
  spm_model: str = ""
  hf_tokenizer: str = ""
  vocab_size: int = 0
  eos_id: int = -1

  def __getitem__(self, name):  # Lets code index a spec like a ConfigDict.
    return getattr(self, name)

  def get(self, name, default=None):
    return getattr(self, name, default)


def resolve_data_dir(data_dir: str) -> str:
  """`config.data.data_dir`, with "" meaning the per-user default cache."""
  return os.path.abspath(os.path.expanduser(data_dir or DEFAULT_DATA_DIR))


_FIELDS = {f.name: f for f in dataclasses.fields(DataSpec)}


def to_spec(config_data) -> DataSpec:
  """A DataSpec from a ConfigDict, dict or DataSpec; unknown fields are a ValueError."""
  if isinstance(config_data, DataSpec):
    return config_data
  items = dict(config_data.items()) if hasattr(config_data, "items") else dict(vars(config_data))
  unknown = sorted(set(items) - set(_FIELDS))
  if unknown:
    raise ValueError(f"config.data has unknown field(s) {unknown}; valid: {sorted(_FIELDS)}.")
  values = {}
  for name, value in items.items():
    kind = _FIELDS[name].type
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
      raise ValueError(f"config.data.{name}={value!r}: must be an integer.")
    if kind is str and not isinstance(value, str):
      raise ValueError(f"config.data.{name}={value!r}: must be a string.")
    values[name] = value
  return DataSpec(**values)


def _fail(name: str, value, valid: str):
  raise ValueError(f"config.data.{name}={value!r} is invalid; valid: {valid}.")


def validate(config_data, model_max_seq_len: int = 0, vocab_size: int = 0) -> DataSpec:
  """Checks `config.data` before anything is compiled; raises ValueError naming field, value and
  what is valid. `model_max_seq_len` / `vocab_size` of 0 skip the checks against the model.

  Cheap: it opens the tokenizer (to compare vocabularies) and checks paths exist, but reads no data.
  """
  return validate_with_tokenizer(config_data, model_max_seq_len, vocab_size)[0]


def validate_with_tokenizer(config_data, model_max_seq_len: int = 0, vocab_size: int = 0):
  """`validate`, also returning the tokenizer it opened (so callers need not load it twice)."""
  spec = to_spec(config_data)
  for name in ("seq_len", "batch_size", "shuffle_buffer"):
    if spec[name] < 1:
      _fail(name, spec[name], "an integer >= 1")
  for name in ("eval_batches", "prefetch", "workers"):
    if spec[name] < 0:
      _fail(name, spec[name], "an integer >= 0")
  if spec.source not in sources.SOURCES:
    _fail("source", spec.source, " | ".join(sources.SOURCES))
  if spec.tokenizer not in tokenizer_lib.KINDS:
    _fail("tokenizer", spec.tokenizer, " | ".join(tokenizer_lib.KINDS))
  if spec.mode not in MODES:
    _fail("mode", spec.mode, "'' (the source's default) | array | stream")
  if spec.shard_by not in SHARD_BY:
    _fail("shard_by", spec.shard_by, " | ".join(SHARD_BY))
  if model_max_seq_len and spec.seq_len > model_max_seq_len:
    _fail("seq_len", spec.seq_len, f"at most the model's max_seq_len, {model_max_seq_len}")
  if spec.tokenizer == "pretokenized" and spec.source != "parquet":
    _fail("tokenizer", spec.tokenizer, "bytes | sentencepiece | hf for a text source "
          f"({spec.source!r}); 'pretokenized' only with source 'parquet'")
  _check_paths(spec)
  tok = tokenizer_lib.make_tokenizer(spec)  # Raises for a missing model file or a bad eos_id.
  if vocab_size and tok.vocab_size > vocab_size:
    raise ValueError(f"config.data.tokenizer={spec.tokenizer!r} has vocab_size {tok.vocab_size}, "
                     f"more than the model's vocab_size {vocab_size}; valid: a model vocab_size >= "
                     f"{tok.vocab_size} (config.model.vocab_size = 0 takes the tokenizer's).")
  return spec, tok


def validate_workers(spec: DataSpec, mode: str) -> None:
  """A packed stream is sequential: one worker process per replica at most (see iterator.py)."""
  if mode == "stream" and spec.workers > 1:
    _fail("workers", spec.workers, "0 or 1 in stream mode (a replica's packed stream is read by "
          "one process); any count >= 0 in array mode")


def _check_paths(spec: DataSpec) -> None:
  if spec.source == "c4_json":
    if not spec.path or not os.path.isdir(os.path.expanduser(spec.path)):
      _fail("path", spec.path, "an existing directory holding c4-train.*.json.gz files")
  if spec.source in ("parquet", "text"):
    for name in ("train_files", "eval_files"):
      sources.expand_globs(spec[name], name)  # Raises naming the pattern that matches nothing.
  if spec.source == "tfds" and not spec.tfds_name:
    _fail("tfds_name", spec.tfds_name, "a TFDS dataset name such as 'c4/en'")
  if spec.tokenizer == "sentencepiece" and not os.path.isfile(os.path.expanduser(spec.spm_model)):
    _fail("spm_model", spec.spm_model, "the path of an existing SentencePiece .model file")
