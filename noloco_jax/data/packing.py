"""Documents to token streams: tokenize, range-check, append the separator; cache whole splits.

Packing rule (both modes): each document becomes its tokens followed by one `eos_id`, documents are
concatenated in order, and the stream is cut into consecutive, non-overlapping sequences of exactly
L+1 tokens (inputs and shifted targets). A sequence may span documents; the separator tells the
model where one ends. Nothing is truncated or padded; only the final partial sequence of a split
(fewer than L+1 tokens) is left out.
"""

import os

from absl import logging
import numpy as np

from noloco_jax.data import locking
from noloco_jax.data import sources
from noloco_jax.data import stdlib_builder

_CACHE_SUBDIR = "noloco_jax_tokens"
_FORMAT_VERSION = 1  # Bump when the packing rule changes, so old caches are not reused.


def document_tokens(doc: sources.Document, tok, eos_id: int, vocab_size: int, where: str) -> np.ndarray:
  """Token ids of one document plus the separator, checked to lie in [0, vocab_size)."""
  ids = tok.encode(doc) if isinstance(doc, str) else np.asarray(doc)
  out = np.empty(len(ids) + 1, dtype=np.int32)
  out[:-1] = ids
  out[-1] = eos_id
  check_ids(out, vocab_size, where)
  return out


def check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
  """ValueError if any id falls outside the model's vocabulary (it would index past the embedding)."""
  if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size}) "
                     f"({bad.size} such ids); check config.data.tokenizer / vocab_size against "
                     "config.model.vocab_size.")


def _dtype_for(vocab_size: int) -> np.dtype:
  # Half the disk and page cache for vocabularies that fit 16 bits (bytes, most SentencePiece models).
  return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def token_array(source: sources.Source, tok, data_dir: str, vocab_size: int) -> np.ndarray:
  """The whole split as one token stream (documents in unit order, each + separator), memory-mapped.

  Built once per (source content, tokenizer) into `<data_dir>/noloco_jax_tokens/` under a lock;
  every later call, in any process, maps the file. Meant for corpora that fit on disk comfortably
  (`mode = "array"`); larger ones stream.
  """
  dtype = _dtype_for(tok.vocab_size)
  key = f"v{_FORMAT_VERSION}-{source.fingerprint()}-{tok.fingerprint}-{dtype.name}"
  directory = os.path.join(stdlib_builder.resolve_data_dir(data_dir), _CACHE_SUBDIR)
  path = os.path.join(directory, key + ".bin")
  if not os.path.exists(path):
    with locking.file_lock(path + ".lock"):
      if not os.path.exists(path):  # Another process may have built it while we waited.
        locking.atomic_write(path, lambda tmp: _write_stream(source, tok, tmp, dtype, vocab_size))
  tokens = np.memmap(path, dtype=dtype, mode="r")
  if tokens.size == 0:
    raise ValueError(f"{source.name}: no tokens (every document empty or skipped); check the data.")
  check_ids(tokens, vocab_size, f"{source.name} (cached tokens {path})")
  return tokens


def _write_stream(source: sources.Source, tok, tmp: str, dtype: np.dtype, vocab_size: int) -> None:
  n_docs = n_tokens = 0
  # Appending chunk by chunk keeps memory flat however large the split is.
  with open(tmp, "wb") as f:
    for unit in range(source.num_units):
      for i, doc in source.read(unit):
        if doc is None:
          continue
        ids = document_tokens(doc, tok, tok.eos_id, vocab_size, f"{source.unit_name(unit)} doc {i}")
        f.write(ids.astype(dtype).tobytes())
        n_docs += 1
        n_tokens += ids.size
  logging.info("Tokenized %s: %d documents, %d tokens (%s); skipped or repaired: %s",
               source.name, n_docs, n_tokens, tok.fingerprint, source.log.counts or "none")
