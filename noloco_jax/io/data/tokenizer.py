"""Tokenizers chosen by `config.data.tokenizer`: bytes | sentencepiece | hf | pretokenized.

Every tokenizer has `vocab_size`, `eos_id` (the end-of-document separator used for packing),
`encode(str) -> np.ndarray[int]`, `encode_batch(list[str])` (parallel where the library allows),
`decode(ids) -> str` and `fingerprint`, a short string that names
the exact vocabulary (a hash of the model file, not its path) so token caches built with one
tokenizer are never read with another.
"""

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from noloco_jax.config.data import TOKENIZERS as KINDS  # config.data.tokenizer


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255 and 256 as the end-of-document separator (vocab 257).

  No training, no files, lossless: the default for the embedded corpus.
  """

  vocab_size = 257
  eos_id = 256
  fingerprint = "bytes"

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Bytes back to text; separators are dropped (they are not text) and bad UTF-8 is replaced."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > self.eos_id):
      raise ValueError(f"ByteTokenizer.decode: ids must lie in [0, {self.eos_id}], got "
                       f"[{ids.min()}, {ids.max()}].")
    return ids[ids != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model file (train one with `python -m noloco_jax.io.data.train_spm`)."""

  def __init__(self, model_path: str):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    model_path = os.path.expanduser(model_path)
    if not model_path or not os.path.isfile(model_path):
      raise ValueError(f"config.data.spm_model={model_path!r}: no such file; it must be the .model "
                       "file of a SentencePiece model (see `python -m noloco_jax.io.data.train_spm`).")
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self.vocab_size = int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      raise ValueError(f"config.data.spm_model={model_path!r} has no end-of-sequence piece "
                       "(eos_id = -1); train it with an EOS id (train_spm does).")
    self.fingerprint = "spm-" + _sha256_file(model_path)[:16]

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    # SentencePiece encodes a list on its own C++ threads: the pipeline's main cost, parallelised.
    ids = self._sp.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)
    return [np.asarray(x, dtype=np.int32) for x in ids]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


_HF_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


class HFTokenizer:
  """A Hugging Face tokenizer by hub name or local path (optional extra: `pip install .[hf]`).

  Uses the `tokenizers` package when present (a `tokenizer.json` file or directory, or a hub name),
  else `transformers`. A gated hub model reads its access token from the environment variable
  HF_TOKEN, never from the config, so tokens do not end up in logged configs or checkpoints.
  """

  def __init__(self, name_or_path: str, eos_id: int = -1):
    if not name_or_path:
      raise ValueError("config.data.hf_tokenizer is empty; give a hub name (e.g. "
                       "'meta-llama/Meta-Llama-3-8B') or a local tokenizer.json / directory.")
    token = os.environ.get("HF_TOKEN") or None
    self._encode, self._encode_batch, self._decode, vocab, eos = _load_hf(name_or_path, token)
    self.vocab_size = int(vocab)
    self.eos_id = int(eos_id) if eos_id >= 0 else eos
    if self.eos_id is None or not 0 <= self.eos_id < self.vocab_size:
      raise ValueError(f"config.data.hf_tokenizer={name_or_path!r}: no end-of-text token found "
                       f"(looked for {_HF_EOS_CANDIDATES}); set config.data.eos_id.")
    local = os.path.join(name_or_path, "tokenizer.json") if os.path.isdir(name_or_path) else name_or_path
    # A local file is named by its content (caches follow edits); a hub name by the name.
    content = _sha256_file(local) if os.path.isfile(local) else name_or_path
    identity = f"{content}|{vocab}|{self.eos_id}".encode()
    self.fingerprint = "hf-" + hashlib.sha256(identity).hexdigest()[:16]

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._encode(text), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.int32) for x in self._encode_batch(list(texts))]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self._decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _load_hf(name_or_path: str, token: str | None):
  """(encode, encode_batch, decode, vocab_size, eos id or None) from `tokenizers`, else `transformers`.

  Special tokens (BOS/EOS) are never added by the tokenizer: packing puts its own separator.
  """
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    tokenizers = None
  if tokenizers is not None:
    path = name_or_path
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(path):
      tok = tokenizers.Tokenizer.from_file(path)
    else:
      tok = tokenizers.Tokenizer.from_pretrained(name_or_path, token=token)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = next((tok.token_to_id(t) for t in _HF_EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    return (lambda s: tok.encode(s, add_special_tokens=False).ids,
            lambda ss: [e.ids for e in tok.encode_batch(ss, add_special_tokens=False)],  # Rust threads.
            tok.decode, vocab, eos)
  try:
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("config.data.tokenizer='hf' needs the `tokenizers` or `transformers` package: "
                      "pip install 'noloco_jax[hf]'.") from e
  tok = transformers.AutoTokenizer.from_pretrained(name_or_path, token=token)
  return (lambda s: tok.encode(s, add_special_tokens=False),
          lambda ss: tok(ss, add_special_tokens=False)["input_ids"],
          tok.decode, len(tok), tok.eos_token_id)


class PretokenizedVocab:
  """For data stored as token ids (parquet): only the vocabulary size and separator are known."""

  def __init__(self, vocab_size: int, eos_id: int):
    if vocab_size < 1:
      raise ValueError(f"config.data.vocab_size={vocab_size}: tokenizer 'pretokenized' needs the "
                       "vocabulary size of the stored ids (a positive integer).")
    if not 0 <= eos_id < vocab_size:
      raise ValueError(f"config.data.eos_id={eos_id}: tokenizer 'pretokenized' needs the separator id, "
                       f"in [0, {vocab_size}).")
    self.vocab_size = int(vocab_size)
    self.eos_id = int(eos_id)
    self.fingerprint = f"pretokenized-{vocab_size}-{eos_id}"

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def encode(self, text: str) -> np.ndarray:
    raise ValueError("config.data.tokenizer='pretokenized' cannot encode text; the source must supply "
                     "token ids (source 'parquet'), or choose bytes | sentencepiece | hf.")

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1))


def make_tokenizer(config_data):
  """The tokenizer named by `config_data.tokenizer`."""
  kind = config_data.tokenizer
  if kind == "bytes":
    return ByteTokenizer()
  if kind == "sentencepiece":
    return SentencePieceTokenizer(config_data.spm_model)
  if kind == "hf":
    return HFTokenizer(config_data.hf_tokenizer, config_data.eos_id)
  if kind == "pretokenized":
    return PretokenizedVocab(config_data.vocab_size, config_data.eos_id)
  raise ValueError(f"config.data.tokenizer={kind!r} is unknown; valid: {', '.join(KINDS)}.")
