"""What every document source is: the `Source` interface, the bad-input log, shared file helpers.

The sources themselves live in tfds_sources.py and file_sources.py; sources.make_source picks one
by `config.data.source`. A source is one split of a corpus seen as an ordered list of *units* (files, or ranges of records),
each an ordered list of *documents* (text, or token ids for pre-tokenized data). Units are what the
streaming pipeline deals to replicas and shuffles per epoch; a position inside a unit is a document
index, so `read(unit, start)` lets an iterator resume exactly where it stopped.

Bad input is never dropped silently: `InputLog` counts every replaced or skipped item and logs it.
"""

import glob
import hashlib
import os
import threading
from collections.abc import Iterator

from absl import logging
import numpy as np

from noloco_jax.config import ConfigError

Document = str | np.ndarray  # Text to tokenize, or token ids (pre-tokenized sources).


class InputLog:
  """Counts bad input by kind ('non_utf8', 'empty', ...) and logs it: never a silent skip.

  Each kind is logged on its first few occurrences and then at every power of two, so a corpus with
  millions of bad lines neither floods the log nor goes unreported.
  """

  _VERBOSE = 5

  def __init__(self, name: str):
    self.name = name
    self.counts: dict[str, int] = {}
    self._lock = threading.Lock()  # The prefetch thread and the caller may both read.

  def note(self, kind: str, where: str, action: str) -> None:
    with self._lock:
      n = self.counts[kind] = self.counts.get(kind, 0) + 1
    if n <= self._VERBOSE or (n & (n - 1)) == 0:
      logging.warning("data source %s: %s at %s (%s); %d so far.", self.name, kind, where, action, n)


def decode_utf8(raw: bytes, where: str, log: InputLog) -> str:
  """UTF-8 text; invalid bytes become U+FFFD, counted and logged as 'non_utf8'."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    log.note("non_utf8", where, "invalid bytes replaced by U+FFFD")
    return raw.decode("utf-8", errors="replace")


def expand_globs(patterns: str, field: str) -> list[str]:
  """Sorted files matching comma-separated glob patterns; a ConfigError naming `field` if none do."""
  if not patterns:
    raise ConfigError(f"config.data.{field} is empty; give a file glob (comma-separated for several).")
  files = set()
  for pattern in patterns.split(","):
    pattern = os.path.expanduser(pattern.strip())
    matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    if not matched:
      raise ConfigError(f"config.data.{field}={patterns!r}: pattern {pattern!r} matches no file.")
    files.update(os.path.abspath(p) for p in matched)
  return sorted(files)


def files_fingerprint(paths: list[str]) -> str:
  """Names a set of files by path, size and modification time: enough to invalidate a cache."""
  h = hashlib.sha256()
  for p in paths:
    st = os.stat(p)
    h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:16]


class Source:
  """One split of a corpus: `num_units` units of documents. Subclasses fill in the rest."""

  name = "source"
  default_mode = "stream"  # "array" (tokenize all once, shuffle sequences) or "stream".
  log: InputLog

  @property
  def num_units(self) -> int:
    raise NotImplementedError

  def unit_name(self, unit: int) -> str:
    """Human-readable name of a unit, for messages."""
    return f"{self.name} unit {unit}"

  def read(self, unit: int, start: int = 0) -> Iterator[tuple[int, Document | None]]:
    """Yields (document index, document) from index `start` of `unit` on.

    A document may be None where the index exists but holds nothing usable (an empty line, a
    skipped record): the index still counts, so positions stay stable across runs.
    """
    raise NotImplementedError

  def fingerprint(self) -> str:
    """Identifies this split's content, for cache keys."""
    raise NotImplementedError
