"""TFDS-backed sources: the embedded stdlib corpus and any prepared TFDS dataset.

Neither format needs TensorFlow. array_record builds are read with `tfds.data_source` (random
access); a unit is a range of `records_per_unit` consecutive records. tfrecord builds (e.g. `c4/en`
prepared the classic way) are read file by file with Grain's TFRecord reader, and each record is
parsed by TFDS's NumPy example parser; a unit is one file. Nothing is ever downloaded here: a
dataset that is not prepared in the data dir is an error that says how to prepare it.
"""

import os
from collections.abc import Iterator

import numpy as np

from noloco_jax.io.data import documents
from noloco_jax.io.data import spec as spec_lib
from noloco_jax.io.data import stdlib_builder

# Records per unit for random-access builds: small enough that units outnumber replicas on the
# stdlib corpus (1,730 train files -> 109 units), large enough that a per-epoch shuffle of C4's
# 365M records stays a shuffle of 1.4M unit ids.
_STDLIB_RECORDS_PER_UNIT = 16
_TFDS_RECORDS_PER_UNIT = 256
_READ_CHUNK = 64  # Records fetched per data-source call.


def _to_document(value, where: str, log: documents.InputLog) -> documents.Document | None:
  """A text (bytes/str) or token-id feature value as a document; None (counted) when empty."""
  if isinstance(value, bytes):
    value = documents.decode_utf8(value, where, log)
  elif isinstance(value, np.ndarray) and value.dtype.kind in "iu":
    value = value.reshape(-1)
  elif isinstance(value, np.ndarray) and value.dtype == object and value.size == 1:
    return _to_document(value.item(), where, log)
  elif not isinstance(value, str):
    raise ValueError(f"{where}: the text field holds {type(value).__name__}, expected text or token ids.")
  if len(value) == 0:
    log.note("empty", where, "skipped")
    return None
  return value


class _RecordRangeSource(documents.Source):
  """A random-access split (array_record data source) cut into units of consecutive records."""

  def __init__(self, data_source, text_key: str, records_per_unit: int):
    self._ds = data_source
    self._text_key = text_key
    self._per_unit = records_per_unit
    self._len = len(data_source)

  @property
  def num_units(self) -> int:
    return -(-self._len // self._per_unit)

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, documents.Document | None]]:
    lo = unit * self._per_unit
    hi = min(lo + self._per_unit, self._len)
    for a in range(lo + start, hi, _READ_CHUNK):
      idx = list(range(a, min(a + _READ_CHUNK, hi)))
      for i, rec in zip(idx, self._ds.__getitems__(idx)):
        yield i - lo, _to_document(rec[self._text_key], f"{self.name} record {i}", self.log)


class StdlibSource(_RecordRangeSource):
  """The running Python's standard library (built into the TFDS cache on first use)."""

  default_mode = "array"

  def __init__(self, data_dir: str, split: str):
    builder = stdlib_builder.prepare(data_dir)
    self.name = f"stdlib/{builder.builder_config.name}/{split}"
    self.log = documents.InputLog(self.name)
    super().__init__(builder.as_data_source(split=split), "text", _STDLIB_RECORDS_PER_UNIT)

  def fingerprint(self) -> str:
    return self.name.replace("/", "_")


class TfdsSource(documents.Source):
  """Any TFDS dataset already prepared in `config.data.data_dir` (`config.data.tfds_name`)."""

  def __init__(self, config_data, split: str):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    name = config_data.tfds_name
    if not name:
      raise ValueError("config.data.tfds_name is empty; source 'tfds' needs a dataset name such as "
                       "'c4/en' or 'c4/en:3.1.0'.")
    data_dir = spec_lib.resolve_data_dir(config_data.data_dir)
    try:
      builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # TFDS raises several kinds for an unknown or unbuilt dataset.
      raise ValueError(f"config.data.tfds_name={name!r}: not found in config.data.data_dir={data_dir!r} "
                       f"({type(e).__name__}: {e}).") from e
    if not builder.is_prepared():
      raise ValueError(f"config.data.tfds_name={name!r} is not prepared in {data_dir!r}; nothing is "
                       "downloaded at run time: prepare it first (e.g. `tfds build c4/en "
                       f"--data_dir={data_dir}`, see docs/data.md), or set config.data.data_dir.")
    if split not in builder.info.splits:
      raise ValueError(f"split {split!r} (config.data.train_split / eval_split) not in {name!r}; "
                       f"valid: {sorted(builder.info.splits)}.")
    self._text_key = config_data.text_field
    if self._text_key not in builder.info.features:
      raise ValueError(f"config.data.text_field={self._text_key!r} is not a feature of {name!r}; "
                       f"valid: {sorted(builder.info.features)}.")
    self.name = f"tfds/{builder.info.full_name}/{split}"
    self.log = documents.InputLog(self.name)
    self._builder = builder
    self._fingerprint = documents.files_fingerprint(
        sorted(str(p) for p in builder.info.splits[split].filepaths))
    if builder.info.file_format.value == "array_record":
      self._ranges = _RecordRangeSource(builder.as_data_source(split=split), self._text_key,
                                        _TFDS_RECORDS_PER_UNIT)
      self._ranges.name, self._ranges.log = self.name, self.log
      self._files = None
    else:
      self._ranges = None
      self._files = [str(p) for p in builder.info.splits[split].filepaths]

  @property
  def num_units(self) -> int:
    return self._ranges.num_units if self._ranges else len(self._files)

  def unit_name(self, unit: int) -> str:
    return self._files[unit] if self._files else super().unit_name(unit)

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, documents.Document | None]]:
    if self._ranges:
      yield from self._ranges.read(unit, start)
      return
    import grain  # pylint: disable=g-import-not-at-top

    path = self._files[unit]
    features = self._builder.info.features
    # The reader only frames records; skipped records are never parsed: cheap resumption mid-file.
    for i, serialized in enumerate(iter(grain.experimental.TFRecordIterDataset(path))):
      if i < start:
        continue
      value = features.deserialize_example_np(serialized)[self._text_key]
      yield i, _to_document(value, f"{os.path.basename(path)} record {i}", self.log)

  def fingerprint(self) -> str:
    return self.name.replace("/", "_").replace(":", "_") + "-" + self._fingerprint
