r"""Trains a SentencePiece tokenizer on the training split of any configured text source.

    python -m noloco_jax.io.data.train_spm --config=configs/c4.py --config.data.path=/data/c4/en \
        --vocab_size=32000 --output=/data/c4_spm --max_chars=200000000

writes /data/c4_spm.model (and .vocab); then run with `--config.data.tokenizer=sentencepiece
--config.data.spm_model=/data/c4_spm.model`. The model has unk = 0, eos = 1 (the document
separator used for packing), no bos/pad, and byte fallback, so any text encodes without unknowns.

Documents are read in the source's unit order and split into lines (SentencePiece's "sentences");
reading stops after `max_chars` characters, which bounds time and memory on large corpora.
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from noloco_jax.config import ConfigError
from noloco_jax.config import cli
from noloco_jax.io.data import sources
from noloco_jax.io.data import spec as spec_lib

class UsageError(ValueError):
  """A flag of this program out of its range; the message is one line naming it."""


_MAX_LINE = 4096  # SentencePiece skips longer "sentences"; cut them instead, at this many characters.


def _lines(source: sources.Source, max_chars: int):
  seen = 0
  for unit in range(source.num_units):
    for _, doc in source.read(unit):
      if doc is None:
        continue
      if not isinstance(doc, str):
        raise ValueError(f"{source.name} holds token ids, not text: nothing to train a tokenizer on.")
      for line in doc.split("\n"):
        for a in range(0, len(line), _MAX_LINE):
          piece = line[a:a + _MAX_LINE]
          if piece.strip():
            yield piece
            seen += len(piece)
            if seen >= max_chars:
              return


def train_sentencepiece(config_data, vocab_size: int, output: str, max_chars: int = 100_000_000,
                        model_type: str = "unigram") -> str:
  """Trains on `config_data`'s training split; returns the path of the written .model file."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  spec = spec_lib.check_source_paths(config_data)  # the tokenizer's own file is what this makes: not checked
  if vocab_size < 260:  # 256 byte-fallback pieces + unk + eos + a few real pieces.
    raise UsageError(f"--vocab_size={vocab_size} is not valid: at least 260 (byte fallback uses 256 ids).")
  source = sources.make_source(spec, "train")
  os.makedirs(os.path.dirname(os.path.abspath(output)) or ".", exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=_lines(source, max_chars),
      model_prefix=output,
      vocab_size=vocab_size,
      model_type=model_type,
      byte_fallback=True,  # Unseen characters become bytes rather than <unk>.
      character_coverage=0.9995,
      # Lossless: no NFKC folding and no collapsing of runs of spaces (indentation is content).
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
      max_sentence_length=_MAX_LINE * 4,  # In bytes; a cut line of 4096 characters always fits.
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
  )
  logging.info("Wrote %s.model (vocab %d) from %s; bad input: %s", output, vocab_size, source.name,
               source.log.counts or "none")
  return output + ".model"


def _define_flags():
  # Defined only when run as a program: importing train_sentencepiece (tests, notebooks) must not
  # claim global absl flag names such as --config that the trainer's main defines too.
  flags.DEFINE_integer("vocab_size", 8000, "Number of pieces (the tokenizer's vocab_size).")
  flags.DEFINE_string("output", None, "Output prefix: writes PREFIX.model and PREFIX.vocab.", required=True)
  flags.DEFINE_integer("max_chars", 100_000_000, "Stop reading after this many characters.")
  flags.DEFINE_enum("model_type", "unigram", ["unigram", "bpe"], "SentencePiece algorithm.")
  return config_flags.DEFINE_config_file("config", "configs/default.py", "Config whose data source to use.")


def main(config_flag, argv):
  del argv
  f = flags.FLAGS
  try:  # bad input is one line naming the field or flag, exit status 2, as for the trainer (main.py)
    path = train_sentencepiece(config_flag.value.data, f.vocab_size, f.output, f.max_chars, f.model_type)
  except (ConfigError, UsageError) as e:
    cli.exit_usage(str(e))
  print(path)


if __name__ == "__main__":
  _config_flag = _define_flags()
  app.run(lambda argv: main(_config_flag, argv), flags_parser=cli.parse_flags)
