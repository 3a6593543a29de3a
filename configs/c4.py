"""C4 English with the paper's small model (docs/method.md §10): NoLoCo on 8 replicas.

Prepare the data once (docs/data.md, "C4 (English)"), then, with C4's JSON-lines files and a
SentencePiece model trained on them:

    python -m noloco_jax.main --config=configs/c4.py --workdir=runs/c4 \
        --config.data.path=/data/c4/en --config.data.spm_model=/data/c4_spm.model

Arguments (comma-separated, after `configs/c4.py:`):
  tfds    read the TFDS build `c4/en` prepared in --config.data.data_dir instead of JSON files;
  llama3  tokenize with the Llama-3 tokenizer (`pip install .[hf]`, HF_TOKEN in the environment),
          as the reference did, instead of SentencePiece;
  smoke, model=NAME   as in configs/default.py.
"""

import ml_collections

from noloco_jax.config import files as config_files


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  default = config_files.load_sibling(__file__, "default")
  config = default.get_config()
  config.num_steps = 25_000  # Reference: 25k steps.
  config.eval_every = 1000
  config.log_every = 50
  config.checkpoint_every = 1000
  config.model.preset = "small"
  config.inner.lr = 6e-4  # Reference, small model.
  config.inner.warmup_steps = 1000

  config.data.source = "c4_json"
  config.data.path = ""  # Directory with c4-train.*.json.gz / c4-validation.*.json.gz (required).
  config.data.tokenizer = "sentencepiece"
  config.data.spm_model = ""  # From `python -m noloco_jax.io.data.train_spm --config=configs/c4.py ...`.
  config.data.seq_len = 1024  # Reference: 1024 (its C4 loader yields 1025 tokens, as we do).
  # 8 replicas x 64 sequences x 1024 tokens = 0.5M tokens per inner step, the paper's small batch.
  config.data.batch_size = 64
  config.data.eval_batches = 16  # 16 x 64 x 1024 = 1M validation tokens per evaluation.
  # A stream refills all replicas' shuffle blocks at once, every shuffle_buffer / batch_size = 4 steps;
  # prefetching twice that hides the refill from the training loop.
  config.data.prefetch = 8
  config.data.shuffle_buffer = 256  # Sequences (256 x 1025 tokens) shuffled together per replica.

  rest = []
  for part in (arg or "").split(","):
    if part == "tfds":
      config.data.source = "tfds"
      config.data.tfds_name = "c4/en"
    elif part == "llama3":
      config.data.tokenizer = "hf"
      config.data.hf_tokenizer = "meta-llama/Meta-Llama-3-8B"
    elif part:
      rest.append(part)
  if rest:
    default._apply_arg(config, ",".join(rest))  # pylint: disable=protected-access
  return config
