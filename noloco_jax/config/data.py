"""`config.data`: the corpus, the tokenizer and the batch shape (noloco_jax/io/data/).

Everything in noloco_jax/io/data reads a `DataSpec`, never the ConfigDict. This module checks what
the fields alone decide; noloco_jax/io/data/spec.py then checks what needs the file system or the
tokenizer (paths exist, vocabularies fit the model).
"""

import dataclasses

from noloco_jax.config.fields import Section, at_least, fail, one_of

SOURCES = ("stdlib", "tfds", "c4_json", "parquet", "text")
TOKENIZERS = ("bytes", "sentencepiece", "hf", "pretokenized")
MODES = ("", "array", "stream")
SHARD_BY = ("auto", "file", "document")


@dataclasses.dataclass(frozen=True)
class DataSpec(Section):
  PATH = "data"

  # stdlib = the embedded corpus (the running Python's standard-library sources, built into the TFDS
  # cache on first use) | tfds (a TFDS dataset prepared in data_dir) | c4_json (C4 JSON-lines files
  # in `path`) | parquet (pre-tokenized rows; train_files/eval_files) | text (train_files/eval_files).
  source: str = "stdlib"
  # bytes (256 byte ids + separator 256, vocab 257) | sentencepiece (spm_model) | hf (hf_tokenizer)
  # | pretokenized (parquet ids as stored; give vocab_size and eos_id).
  tokenizer: str = "bytes"
  seq_len: int = 128  # L: each example holds L+1 tokens (inputs and shifted targets).
  batch_size: int = 4  # Sequences per replica per inner step.
  eval_batches: int = 4  # Validation batches per evaluation (the same for every replica).
  data_dir: str = ""  # TFDS data dir and token caches; "" = ~/.cache/noloco_jax/tensorflow_datasets.
  prefetch: int = 2  # Batches prepared ahead in Grain's background thread; 0 = in the caller.
  # Grain worker processes per replica, reading and tokenising off the trainer (same batches; resume
  # with the same value); stream mode: 0 or 1 (a packed stream is sequential). 0 = none.
  workers: int = 0
  # "" = the source's default: "array" (tokenize the split once into a cached array, shuffle whole
  # sequences; stdlib, text) or "stream" (tokenize while reading, for corpora too big for that).
  mode: str = ""
  # Stream mode: "file" deals whole files (or record ranges) to replicas; "document" lets every
  # replica read every file and keep every R-th document; "auto" = file when files >= replicas.
  shard_by: str = "auto"
  shuffle_buffer: int = 256  # Stream mode: consecutive sequences shuffled together per block.
  train_split: str = "train"  # Split names of tfds / c4_json (the stdlib uses train/validation).
  eval_split: str = "validation"
  tfds_name: str = ""  # Source tfds: dataset name, e.g. "c4/en" or "c4/en:3.1.0".
  text_field: str = "text"  # Source tfds / c4_json: the field holding the document text.
  path: str = ""  # Source c4_json: directory with c4-train.*.json.gz and c4-validation.*.json.gz.
  train_files: str = ""  # Sources parquet / text: glob(s), comma-separated, of training files.
  eval_files: str = ""  # Sources parquet / text: glob(s) of validation files.
  parquet_ids_field: str = "input_ids"  # Source parquet: column of token-id lists.
  parquet_mask_field: str = "attention_mask"  # Source parquet: 0 marks padding to drop (optional column).
  spm_model: str = ""  # Tokenizer sentencepiece: the .model file (python -m noloco_jax.io.data.train_spm).
  hf_tokenizer: str = ""  # Tokenizer hf: hub name or local tokenizer.json/dir; HF_TOKEN env for gated ones.
  vocab_size: int = 0  # Tokenizer pretokenized: vocabulary size of the stored ids.
  eos_id: int = -1  # Separator id for pretokenized (required) and hf (-1 = the tokenizer's end-of-text).

  def check(self) -> None:
    for name in ("seq_len", "batch_size", "shuffle_buffer"):
      at_least(f"data.{name}", getattr(self, name), 1)
    for name in ("eval_batches", "prefetch", "workers"):
      at_least(f"data.{name}", getattr(self, name), 0)
    one_of("data.source", self.source, SOURCES)
    one_of("data.tokenizer", self.tokenizer, TOKENIZERS)
    one_of("data.mode", self.mode, MODES)
    one_of("data.shard_by", self.shard_by, SHARD_BY)
    if self.tokenizer == "pretokenized" and self.source != "parquet":
      fail("data.tokenizer", self.tokenizer, f"bytes | sentencepiece | hf for a text source ({self.source!r}); "
           "'pretokenized' only with source 'parquet'")
