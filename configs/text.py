"""Any local text files (one document per file), byte-level, with the default tiny model.

    python -m noloco_jax.main --config=configs/text.py --workdir=runs/text \
        --config.data.train_files='/data/books/train/*.txt' --config.data.eval_files='/data/books/val/*.txt'

The files are tokenized once into a cache in --config.data.data_dir and shuffled by sequence.
For a SentencePiece vocabulary, train one with
`python -m noloco_jax.io.data.train_spm --config=configs/text.py --config.data.train_files=... --output=PREFIX`
and add `--config.data.tokenizer=sentencepiece --config.data.spm_model=PREFIX.model`.
Arguments after `configs/text.py:` are those of configs/default.py (smoke, model=NAME).
"""

import ml_collections

from noloco_jax.config import files as config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = config_files.load_sibling(__file__, "default").get_config(arg)
  config.data.source = "text"
  config.data.train_files = ""  # Glob(s), comma-separated (required).
  config.data.eval_files = ""  # Glob(s) of held-out files (required).
  return config
