"""Pushshift Reddit, pre-tokenized parquet as in the reference, with the paper's small model.

The reference data are parquet files with an `input_ids` list per row (Llama-3 token ids) and an
optional `attention_mask`; rows are packed with the separator `eos_id` between them. Run:

    python -m noloco_jax.main --config=configs/reddit.py --workdir=runs/reddit \
        --config.data.train_files='/data/reddit/train/*.parquet' \
        --config.data.eval_files='/data/reddit/val/*.parquet'

To print decoded text, use `--config.data.tokenizer=hf --config.data.hf_tokenizer=meta-llama/Meta-Llama-3-8B`
(`pip install .[hf]`, HF_TOKEN in the environment): same ids, plus decoding.
Arguments after `configs/reddit.py:` are those of configs/default.py (smoke, model=NAME).
"""

import ml_collections

from noloco_jax.config import files as config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  default = config_files.load_sibling(__file__, "default")
  config = default.get_config()
  config.num_steps = 25_000
  config.eval_every = 1000
  config.log_every = 50
  config.checkpoint_every = 1000
  config.model.preset = "small"
  config.inner.lr = 6e-4
  config.inner.warmup_steps = 1000

  config.data.source = "parquet"
  config.data.train_files = ""  # Glob(s) of the training parquet files (required).
  config.data.eval_files = ""  # Glob(s) of the held-out files (reference: 10M tokens).
  config.data.tokenizer = "pretokenized"
  config.data.vocab_size = 128_002  # The reference model's vocabulary (Llama-3 ids up to <|end_of_text|>).
  config.data.eos_id = 128_001  # Llama-3 <|end_of_text|>: the separator between rows.
  config.data.seq_len = 1024
  config.data.batch_size = 64  # 8 x 64 x 1024 = 0.5M tokens per inner step.
  config.data.eval_batches = 16
  # A stream refills all replicas' shuffle blocks at once, every shuffle_buffer / batch_size = 4 steps;
  # prefetching twice that hides the refill from the training loop.
  config.data.prefetch = 8
  config.data.shuffle_buffer = 256  # Sequences (256 x 1025 tokens) shuffled together per replica.
  if arg:
    default._apply_arg(config, arg)  # pylint: disable=protected-access
  return config
