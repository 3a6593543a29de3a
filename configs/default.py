"""Default job: 8 replicas of a tiny Llama trained with NoLoCo on the embedded standard-library corpus.

Run (on a laptop CPU; 8 fake CPU devices are created when there are fewer real ones):

    python -m noloco_jax.main --config=configs/default.py --workdir=runs/default

Expected: finishes in a few minutes on 2 CPU cores; validation loss falls from ~5.6 (uniform over
257 byte tokens) to below ~2.5 nats (see README.md for the measured figure).

Shrink to seconds for a smoke test with the argument string `smoke`:

    python -m noloco_jax.main --config=configs/default.py:smoke --workdir=runs/smoke

Every field can be overridden on the command line, e.g. `--config.outer.kind=diloco`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # One seed for everything: initial weights, data order and the pairing schedule.
  config.num_steps = 500  # Inner steps per replica in total.
  config.num_replicas = 8  # N: model replicas (data parallel). Stacked on the `replica` mesh axis.
  # Devices the replicas are spread over; 0 = as many as divide num_replicas (up to all devices).
  # 1 runs the single-device simulator: all replicas on one device, exchange by gather.
  config.num_devices = 0
  # Devices per replica group (the `fsdp` mesh axis): a replica's θ, Adam moments, φ and δ are split
  # over them leaf by leaf, and its batch_size sequences too (noloco_jax/parallel/sharding.py). The job uses
  # num_devices × fsdp devices; fsdp must divide each process's devices and data.batch_size.
  config.fsdp = 1
  config.eval_every = 100  # Steps between evaluations (validation loss/ppl, weight std). 0 = only at the end.
  config.log_every = 25  # Steps between training-metric logs (host fetches only at these steps).
  config.checkpoint_every = 0  # Steps between checkpoints; 0 = only at the end.
  # What a non-finite (NaN/Inf) training loss does: "error" stops the run naming the step and the
  # replica (the last good checkpoint stays as it was); "skip_round" undoes the round it happened in
  # and goes on (see noloco_jax/io/checkpoint.py: RoundGuard).
  config.nan_policy = "error"

  # ---- Checkpoints (orbax, in workdir/checkpoints; see noloco_jax/io/checkpoint.py) ----
  # A run resumes from the latest checkpoint of its own workdir; else it starts from warm_start; else from scratch.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.keep = 3  # Most recent checkpoints kept; >= 2 leaves a fallback if the latest is unreadable.
  # Another run's workdir, checkpoints directory or step directory: start from its weights θ (fresh
  # optimizer, φ = θ, δ = 0, step 0). "" = none. Ignored when the workdir holds a checkpoint.
  config.checkpoint.warm_start = ""
  config.checkpoint.async_save = True  # Write in a background thread; training goes on meanwhile.

  # ---- Model (a Llama decoder; see noloco_jax/models/llama.py) ----
  config.model = ml_collections.ConfigDict()
  config.model.preset = "tiny"  # tiny | small | medium | large (PAPER.md section 2).
  # Size fields: 0 means "take it from the preset"; any positive value overrides the preset.
  config.model.d_model = 0
  config.model.num_layers = 0
  config.model.num_heads = 0
  config.model.mlp_dim = 0
  config.model.vocab_size = 0  # 0 = the tokenizer's vocabulary size.
  config.model.max_seq_len = 0  # 0 = data.seq_len.
  config.model.rope_theta = 10_000.0
  config.model.norm_eps = 1e-6
  config.model.param_dtype = "float32"  # float32 | bfloat16
  config.model.dtype = "float32"  # compute dtype: float32 | bfloat16
  # Recompute each layer's activations in the backward pass instead of storing them: activation
  # memory falls from O(layers) to O(1) layers, for about one extra forward pass of compute.
  config.model.remat = False

  # ---- Data (see noloco_jax/io/data/) ----
  config.data = ml_collections.ConfigDict()
  # stdlib = the embedded corpus (the running Python's standard-library sources, built into the TFDS
  # cache on first use) | tfds (a TFDS dataset prepared in data_dir) | c4_json (C4 JSON-lines files
  # in `path`) | parquet (pre-tokenized rows; train_files/eval_files) | text (train_files/eval_files).
  config.data.source = "stdlib"
  # bytes (256 byte ids + separator 256, vocab 257) | sentencepiece (spm_model) | hf (hf_tokenizer)
  # | pretokenized (parquet ids as stored; give vocab_size and eos_id).
  config.data.tokenizer = "bytes"
  config.data.seq_len = 128  # L: each example holds L+1 tokens (inputs and shifted targets).
  config.data.batch_size = 4  # Sequences per replica per inner step.
  config.data.eval_batches = 4  # Validation batches per evaluation (the same for every replica).
  config.data.data_dir = ""  # TFDS data dir and token caches; "" = ~/.cache/noloco_jax/tensorflow_datasets.
  config.data.prefetch = 2  # Batches prepared ahead in a background thread; 0 = in the caller.
  # "" = the source's default: "array" (tokenize the split once into a cached array, shuffle whole
  # sequences; stdlib, text) or "stream" (tokenize while reading, for corpora too big for that).
  config.data.mode = ""
  # Stream mode: "file" deals whole files (or record ranges) to replicas; "document" lets every
  # replica read every file and keep every R-th document; "auto" = file when files >= replicas.
  config.data.shard_by = "auto"
  config.data.shuffle_buffer = 256  # Stream mode: consecutive sequences shuffled together per block.
  config.data.train_split = "train"  # Split names of tfds / c4_json (the stdlib uses train/validation).
  config.data.eval_split = "validation"
  config.data.tfds_name = ""  # Source tfds: dataset name, e.g. "c4/en" or "c4/en:3.1.0".
  config.data.text_field = "text"  # Source tfds / c4_json: the field holding the document text.
  config.data.path = ""  # Source c4_json: directory with c4-train.*.json.gz and c4-validation.*.json.gz.
  config.data.train_files = ""  # Sources parquet / text: glob(s), comma-separated, of training files.
  config.data.eval_files = ""  # Sources parquet / text: glob(s) of validation files.
  config.data.parquet_ids_field = "input_ids"  # Source parquet: column of token-id lists.
  config.data.parquet_mask_field = "attention_mask"  # Source parquet: 0 marks padding to drop (optional column).
  config.data.spm_model = ""  # Tokenizer sentencepiece: the .model file (python -m noloco_jax.io.data.train_spm).
  config.data.hf_tokenizer = ""  # Tokenizer hf: hub name or local tokenizer.json/dir; HF_TOKEN env for gated ones.
  config.data.vocab_size = 0  # Tokenizer pretokenized: vocabulary size of the stored ids.
  config.data.eos_id = -1  # Separator id for pretokenized (required) and hf (-1 = the tokenizer's end-of-text).

  # ---- Inner optimizer (per replica, every step) ----
  config.inner = ml_collections.ConfigDict()
  config.inner.optimizer = "adam"  # adam | adamw
  config.inner.lr = 3e-3  # Peak learning rate.
  config.inner.warmup_steps = 50  # Linear warm-up (reference: 1000 of 25000 steps).
  config.inner.min_lr_ratio = 0.1  # Cosine decay to lr * min_lr_ratio (reference: max/10).
  config.inner.b1 = 0.9
  config.inner.b2 = 0.95
  config.inner.eps = 1e-8
  config.inner.weight_decay = 0.0  # Only used by adamw (reference: none).
  config.inner.grad_clip = 1.0  # Global-norm clipping; 0 disables.
  # Gradient accumulation (without pipeline stages): each step's batch_size sequences are processed in
  # this many equal slices, one after another, and their gradients averaged: the same update, with
  # the activation memory of one slice. batch_size must be a multiple of microbatches × fsdp.
  config.inner.microbatches = 1

  # ---- Outer step (every H inner steps; see noloco_jax/outer/) ----
  config.outer = ml_collections.ConfigDict()
  config.outer.kind = "noloco"  # noloco | diloco | gossip | ddp | none
  config.outer.inner_steps = 50  # H: inner steps per outer round.
  config.outer.group_size = 2  # n: replicas per averaging group (noloco, gossip).
  config.outer.momentum = 0.5  # alpha (NoLoCo reference 0.5; DiLoCo reference 0.3).
  config.outer.lr = 0.7  # beta: outer learning rate.
  config.outer.gamma = 0.7  # gamma: pull towards the group's mean slow weights (NoLoCo only).
  # Validation refuses an (alpha, gamma) whose cross-replica spread is mean-square unstable for this
  # update (docs/stability.md); True runs it anyway, with a warning (e.g. to study the divergence).
  config.outer.allow_unstable = False
  config.outer.nesterov = False  # DiLoCo only: Nesterov (original DiLoCo) instead of heavy-ball (reference).
  config.outer.message_dtype = "float32"  # float32 | bfloat16: dtype of the exchanged tensor.
  # Storage dtype of the outer state (φ, δ; DiLoCo's φ and momentum): "" = the parameters' dtype,
  # or float32 | bfloat16. The update itself always computes in float32.
  config.outer.state_dtype = ""
  # Keep φ and δ in pinned host memory between rounds (they are read once per round): the device then
  # holds three model-sized copies (θ, Adam m, v) instead of five. Costs two host<->device copies per round.
  config.outer.offload = False
  # How the groups are drawn each round (noloco_jax/outer/pairing.py):
  #   fresh       = a new uniformly random grouping every round (the method); on a mesh the next round's
  #                 program is compiled while the current round's inner steps run (outer/ahead.py);
  #   round_robin = one of the N-1 round-robin matchings (relabelled once), uniform per round; one program;
  #                 every pair meets equally often, but only N-1 matchings occur (group_size 2 only);
  #   fixed       = the same grouping every round (ablation).
  config.outer.pairing = "fresh"

  # ---- Pipeline parallelism (see noloco_jax/parallel/pipeline.py and routing.py) ----
  # S: stages per replica (the `stage` mesh axis; the job uses num_devices × num_stages × fsdp devices).
  # Layers are split evenly (num_layers % S == 0); the embedding runs on the first stage, the head on the last.
  config.num_stages = 1
  config.pipeline = ml_collections.ConfigDict()
  # Where stage s sends a micro-batch: "random" = stage s+1 of a random replica, a fresh permutation per
  # micro-batch and boundary (NoLoCo's implicit mixing); "fixed" = its own replica. Eval always uses fixed.
  config.pipeline.routing = "random"
  config.pipeline.microbatches = 0  # M micro-batches per step (must divide batch_size); 0 = one sequence each.
  config.pipeline.clip = "per_stage"  # grad_clip per stage (reference) | "global" (whole replica, as without stages).

  if arg:
    _apply_arg(config, arg)
  return config


def _apply_arg(config: ml_collections.ConfigDict, arg: str) -> None:
  """`smoke` shrinks the job to seconds; `model=NAME` selects a model preset."""
  for part in arg.split(","):
    key, _, value = part.partition("=")
    if key == "smoke":
      config.num_steps = 12
      config.eval_every = 6
      config.log_every = 3
      config.outer.inner_steps = 3
      config.inner.warmup_steps = 2
      config.data.seq_len = 32
      config.data.batch_size = 2
      config.data.eval_batches = 1
      config.model.d_model = 32
      config.model.num_layers = 1
      config.model.num_heads = 2
      config.model.mlp_dim = 64
    elif key == "model":
      config.model.preset = value
    else:
      raise ValueError(f"configs/default.py: unknown argument {part!r}; valid: 'smoke', 'model=NAME'.")
