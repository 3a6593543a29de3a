"""File-backed sources: C4 JSON lines, pre-tokenized parquet, plain text. One unit = one file.

Units are the files in sorted path order, so every process on every host sees the same list.
"""

import glob
import gzip
import json
import os
from collections.abc import Iterator

import numpy as np

from noloco_jax.config import ConfigError
from noloco_jax.io.data import documents


class _FileSource(documents.Source):
  """A source whose units are whole files, `self._files` (set by the subclass), in a fixed order."""

  _files: list[str]

  @property
  def num_units(self) -> int:
    return len(self._files)

  def unit_name(self, unit: int) -> str:
    return self._files[unit]


class C4JsonSource(_FileSource):
  """C4 as distributed in JSON lines: `c4-{split}.NNNNN-of-NNNNN.json.gz` in one directory.

  One document per line, its text under `text_field`. The document index is the line number, so a
  resumed reader skips lines without parsing them.
  """

  def __init__(self, path: str, split: str, text_field: str):
    # ConfigError: one line naming the field (main.py and train_spm print it and exit 2).
    if not path:
      raise ConfigError("config.data.path is empty; source 'c4_json' needs the directory holding "
                        "c4-train.*.json.gz and c4-validation.*.json.gz.")
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
      raise ConfigError(f"config.data.path={path!r} is not a directory (source 'c4_json'); valid: the directory "
                        "holding c4-train.*.json.gz and c4-validation.*.json.gz.")
    self._files = sorted(glob.glob(os.path.join(path, f"c4-{split}.*.json.gz")) +
                         glob.glob(os.path.join(path, f"c4-{split}.*.json")))
    if not self._files:
      raise ConfigError(f"config.data.path={path!r} holds no c4-{split}.*.json.gz (or .json) file; "
                        "check the directory and config.data.train_split / eval_split.")
    self._field = text_field
    self.name = f"c4_json/{split}"
    self.log = documents.InputLog(self.name)

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, documents.Document | None]]:
    path = self._files[unit]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
      for i, line in enumerate(f):
        if i < start:
          continue
        where = f"{os.path.basename(path)} line {i + 1}"
        line = line.strip()
        if not line:
          self.log.note("empty", where, "skipped")
          yield i, None
          continue
        try:
          record = json.loads(documents.decode_utf8(line, where, self.log))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e}).") from e
        if not isinstance(record, dict) or self._field not in record:
          keys = sorted(record) if isinstance(record, dict) else type(record).__name__
          raise ValueError(f"{path}: line {i + 1} has no field config.data.text_field={self._field!r} "
                           f"(it has {keys}).")
        text = record[self._field]
        if not text:
          self.log.note("empty", where, "skipped")
          text = None
        yield i, text

  def fingerprint(self) -> str:
    return f"c4_json-{self._field}-" + documents.files_fingerprint(self._files)


class TextSource(_FileSource):
  """Local text files, one document per file (comma-separated globs in config.data.*_files)."""

  default_mode = "array"

  def __init__(self, patterns: str, field: str):
    self._files = documents.expand_globs(patterns, field)
    self.name = f"text/{field}"
    self.log = documents.InputLog(self.name)

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, documents.Document | None]]:
    if start > 0:
      return
    path = self._files[unit]
    with open(path, "rb") as f:
      raw = f.read()
    if not raw:
      self.log.note("empty", path, "skipped")
      yield 0, None
      return
    yield 0, documents.decode_utf8(raw, path, self.log)

  def fingerprint(self) -> str:
    return "text-" + documents.files_fingerprint(self._files)


class ParquetSource(_FileSource):
  """Pre-tokenized parquet (the reference's Reddit data): one document per row.

  `ids_field` holds a list of token ids per row; `mask_field`, when the file has it, marks the real
  tokens (1) among padding (0), and only those are kept.
  """

  def __init__(self, patterns: str, field: str, ids_field: str, mask_field: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    self._pq = pq
    self._files = documents.expand_globs(patterns, field)
    self._ids, self._mask = ids_field, mask_field
    self.name = f"parquet/{field}"
    self.log = documents.InputLog(self.name)
    for path in self._files:  # Check the schemas up front: fail before compiling, not hours in.
      names = pq.read_schema(path).names
      if ids_field not in names:
        raise ValueError(f"{path}: parquet file has no column config.data.parquet_ids_field="
                         f"{ids_field!r} (columns: {names}).")

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, documents.Document | None]]:
    path = self._files[unit]
    pf = self._pq.ParquetFile(path)
    if pf.metadata.num_rows == 0:
      self.log.note("empty", path, "skipped: no rows")
      return
    columns = [self._ids] + ([self._mask] if self._mask and self._mask in pf.schema_arrow.names else [])
    row0 = 0
    for g in range(pf.metadata.num_row_groups):
      n = pf.metadata.row_group(g).num_rows
      if row0 + n <= start:  # Whole row groups before the resume point are never read.
        row0 += n
        continue
      table = pf.read_row_group(g, columns=columns)
      ids_offsets, ids = _flat_lists(table.column(self._ids), path, self._ids)
      if len(columns) == 2:
        mask_offsets, mask = _flat_lists(table.column(self._mask), path, self._mask)
        if not np.array_equal(mask_offsets, ids_offsets):
          raise ValueError(f"{path}: row group {g}: {self._mask!r} and {self._ids!r} differ in length.")
      for r in range(max(0, start - row0), n):
        doc = ids[ids_offsets[r]:ids_offsets[r + 1]]
        if len(columns) == 2:
          doc = doc[mask[ids_offsets[r]:ids_offsets[r + 1]] != 0]
        if doc.size == 0:
          self.log.note("empty", f"{path} row {row0 + r}", "skipped")
          doc = None
        yield row0 + r, doc
      row0 += n

  def fingerprint(self) -> str:
    return f"parquet-{self._ids}-{self._mask}-" + documents.files_fingerprint(self._files)


def _flat_lists(column, path: str, name: str) -> tuple[np.ndarray, np.ndarray]:
  """(offsets, values) of a list<int> column: one copy, no per-row Python objects."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  array = column.combine_chunks()
  if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) or not (
      pa.types.is_integer(array.type.value_type)):
    raise ValueError(f"{path}: column {name!r} has type {array.type}; expected a list of integers.")
  if array.null_count:
    raise ValueError(f"{path}: column {name!r} has {array.null_count} null row(s).")
  offsets = array.offsets.to_numpy() - array.offsets[0].as_py()
  values = array.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
  return offsets, values
