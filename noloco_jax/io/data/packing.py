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

from noloco_jax.io.data import locking
from noloco_jax.io.data import documents
from noloco_jax.io.data import spec as spec_lib

_CACHE_SUBDIR = "noloco_jax_tokens"
_FORMAT_VERSION = 1  # Bump when the packing rule changes, so old caches are not reused.
DOCS_PER_BATCH = 64  # Documents tokenized per call: enough to keep a tokenizer's threads busy.


def documents_tokens(docs: list[documents.Document], tok, vocab_size: int,
                     wheres: list[str]) -> list[np.ndarray]:
  """Token ids of each document plus the separator, checked to lie in [0, vocab_size).

  Text is encoded in one `encode_batch` call (parallel for SentencePiece and HF); token-id
  documents pass through.
  """
  texts = [d for d in docs if isinstance(d, str)]
  encoded = iter(tok.encode_batch(texts) if texts else ())
  out = []
  for doc, where in zip(docs, wheres):
    ids = next(encoded) if isinstance(doc, str) else np.asarray(doc)
    tokens = np.empty(len(ids) + 1, dtype=np.int32)
    tokens[:-1] = ids
    tokens[-1] = tok.eos_id
    check_ids(tokens, vocab_size, where)
    out.append(tokens)
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


def token_array(source: documents.Source, tok, data_dir: str, vocab_size: int) -> np.ndarray:
  """The whole split as one token stream (documents in unit order, each + separator), memory-mapped.

  Built once per (source content, tokenizer) into `<data_dir>/noloco_jax_tokens/` under a lock;
  every later call, in any process, maps the file. Meant for corpora that fit on disk comfortably
  (`mode = "array"`); larger ones stream.
  """
  dtype = _dtype_for(tok.vocab_size)
  key = f"v{_FORMAT_VERSION}-{source.fingerprint()}-{tok.fingerprint}-{dtype.name}"
  directory = os.path.join(spec_lib.resolve_data_dir(data_dir), _CACHE_SUBDIR)
  path = os.path.join(directory, key + ".bin")
  if not _is_cached(path):
    with locking.file_lock(path + ".lock"):
      if not _is_cached(path):  # Another process may have built it while we waited.
        # _write_stream raises on a split without tokens, so no empty cache file is ever kept.
        locking.atomic_write(path, lambda tmp: _write_stream(source, tok, tmp, dtype, vocab_size))
  tokens = np.memmap(path, dtype=dtype, mode="r")
  check_ids(tokens, vocab_size, f"{source.name} (cached tokens {path})")
  return tokens


def _is_cached(path: str) -> bool:
  # An empty file is never a cache: earlier versions left one for a split without tokens, and
  # np.memmap cannot map it ("cannot mmap an empty file").
  return os.path.exists(path) and os.path.getsize(path) > 0


def _no_tokens_error(source: documents.Source) -> ValueError:
  names = [source.unit_name(u) for u in range(min(source.num_units, 3))]
  more = f" and {source.num_units - len(names)} more" if source.num_units > len(names) else ""
  skipped = source.log.counts or "none"
  return ValueError(f"{source.name}: no tokens in {', '.join(names)}{more} (every document empty or skipped; "
                    f"skipped: {skipped}); check the data.")


def _write_stream(source: documents.Source, tok, tmp: str, dtype: np.dtype, vocab_size: int) -> None:
  n_docs = n_tokens = 0
  # Appending batch by batch keeps memory flat however large the split is.
  with open(tmp, "wb") as f:
    def flush(batch):
      nonlocal n_docs, n_tokens
      for ids in documents_tokens([d for _, d in batch], tok, vocab_size, [w for w, _ in batch]):
        f.write(ids.astype(dtype).tobytes())
        n_docs += 1
        n_tokens += ids.size
    batch = []
    for unit in range(source.num_units):
      for i, doc in source.read(unit):
        if doc is not None:
          batch.append((f"{source.unit_name(unit)} doc {i}", doc))
        if len(batch) == DOCS_PER_BATCH:
          flush(batch)
          batch = []
    flush(batch)
  if n_tokens == 0:
    raise _no_tokens_error(source)
  logging.info("Tokenized %s: %d documents, %d tokens (%s); skipped or repaired: %s",
               source.name, n_docs, n_tokens, tok.fingerprint, source.log.counts or "none")
