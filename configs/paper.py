"""The NoLoCo paper's experiment grid (docs/method.md §10–11) as one parameterised config.

One run = a model size × a row (GPUs, DP, PP) of the paper's results table × a method × a dataset:

    python -m noloco_jax.main --workdir=runs/small-16gpu-dp8-pp2-noloco-c4 \
        --config=configs/paper.py:model=small,gpus=16,dp=8,pp=2,method=noloco,data=c4 \
        --config.data.path=/data/c4/en

    python -m noloco_jax.main --workdir=runs/large-64gpu-dp16-pp4-diloco-reddit \
        --config=configs/paper.py:model=large,gpus=64,dp=16,pp=4,method=diloco,data=reddit \
        --config.data.train_files='/data/reddit/train/*.parquet' --config.data.eval_files='/data/reddit/val/*.parquet'

Check that a run fits before launching it (no data needed; on a CPU machine the devices are faked):

    python -m noloco_jax.main --dry_run --topology=64x80GB \
        --config=configs/paper.py:model=large,gpus=64,dp=16,pp=4,method=noloco,data=c4,pp_as=fsdp

prints per-device memory (here 64.9 of 74.5 GiB) and the bytes a round sends, and exits 1 if it does
not fit. Measured for every row in experiments/RESULTS.md ("Memory at paper scale"): with
`pp_as=fsdp` every row fits 80 GB; with pipeline stages (the default) 4 of the 7 PP rows do not yet,
because the GPipe schedule keeps every micro-batch's activations until the backward pass.

Expected (docs/method.md §11): final validation perplexity e.g. 33.1 (NoLoCo) / 34.0 (DiLoCo) /
29.1 (FSDP) for small, 16 GPUs, DP 8, PP 2 on C4, after 25,000 steps.

Arguments (comma-separated `key=value`):
  model   small | medium | large                  (the paper's "125M" / "1.3B" / "6.8B")
  gpus, dp, pp                                    a row of the results table: `grid_rows()`
  method  ddp (the FSDP baseline: every step averages gradients over all replicas) | diloco | noloco
  data    c4 (Llama-3 tokenizer, as the reference) | reddit (pre-tokenized Llama-3 ids)
  pp_as   stages (default): PP = pipeline stages (`num_stages`, random routing), the rest of a
          replica's devices fsdp | fsdp: all GPUs / DP devices of a replica on `fsdp`, no pipeline
  smoke   keep the layout (replicas × devices per replica) but shrink the model, batch and steps to
          seconds, on the embedded stdlib corpus: to try a layout end to end on any machine.

How a row maps onto the mesh: DP = `num_replicas` (the `replica` axis). Each replica owns GPUs / DP
devices. By default (`pp_as=stages`) the replica is cut into PP pipeline stages (`num_stages`, the
`stage` mesh axis, GPipe with one sequence per micro-batch and random routing, as the paper), and
any remaining GPUs / (DP × PP) devices of a replica go to `fsdp` (none, for the paper's rows).
With `pp_as=fsdp` all GPUs / DP devices of a replica form its `fsdp` axis instead: the replica's
weights, optimizer state, φ and δ are split over them and its batch too, with gradient accumulation
over micro-batches of `device_seqs` sequences per device. That changes where a replica's memory and
compute live, not the outer algorithm (the same N replicas exchange the same bytes); random pipeline
routing, a PP-only ingredient, is then absent.

Hyperparameters are the paper's: inner Adam (no weight decay, clip 1.0) at 6e-4 / 2e-4 / 1.2e-4,
global batch 0.5M / 1M / 2M tokens of sequences of 1024, 25,000 steps, 1,000 warm-up steps, cosine to
lr/10; NoLoCo α=0.5, β=γ=0.7, n=2, H=50; DiLoCo α=0.3, β=0.7, H=100, heavy-ball (the reference code's).
Precision: bfloat16 compute; float32 parameters, Adam moments and outer state (a float32 master copy,
so that updates of 1e-4 relative size are not rounded away); messages in float32. Memory: layer remat
for medium and large, and for large φ and δ in pinned host memory between rounds (outer.offload).
"""

import ml_collections

from noloco_jax.outer import methods
from noloco_jax.config import files as config_files

# The rows of docs/method.md §11: (model, GPUs, DP, PP).
ROWS = (
    ("small", 8, 8, 1), ("small", 8, 4, 2), ("small", 16, 8, 2), ("small", 32, 16, 2),
    ("medium", 16, 8, 2), ("medium", 32, 16, 2), ("medium", 64, 16, 4),
    ("large", 64, 16, 4),
)
METHODS = ("ddp", "diloco", "noloco")
DATASETS = ("c4", "reddit")

SEQ_LEN = 1024
# Per model size: inner peak learning rate, global batch in tokens (docs/method.md §10), and whether
# layers are recomputed in the backward pass (the larger models' activations would not fit otherwise).
# `device_seqs`: sequences each device processes at once without pipeline stages (gradient
# accumulation over the rest, inner.microbatches): the paper's batches of 64–128 sequences per
# replica do not fit one device's activations in one pass (the logits alone are 0.5 GB per sequence).
# `offload`: φ and δ in pinned host memory between rounds (outer.offload). The large model's float32
# θ, Adam moments, φ and δ are 180 GiB per replica, 45 GiB on each of its 4 devices: with activations
# that exceeds 80 GB (dry run: 91 GiB); without φ and δ on the device it fits (65 GiB; see
# experiments/RESULTS.md, "Memory at paper scale").
SIZES = {
    "small": dict(lr=6e-4, batch_tokens=2 ** 19, remat=False, device_seqs=8, offload=False),
    "medium": dict(lr=2e-4, batch_tokens=2 ** 20, remat=True, device_seqs=8, offload=False),
    "large": dict(lr=1.2e-4, batch_tokens=2 ** 21, remat=True, device_seqs=4, offload=True),
}
# The outer step of each method: the paper's, as each method's spec declares it (noloco_jax/outer/methods/;
# heavy-ball momentum for both).
OUTER = {method: methods.defaults(method) for method in METHODS}
# Vocabularies: the reference model's 128,002 ids for Reddit (Llama-3 ids up to <|end_of_text|>); the
# Llama-3 tokenizer with its 256 added special tokens (128,256) for C4, which is what it reports.
VOCAB = {"c4": 128_256, "reddit": 128_002}


def _sibling(name: str):
  return config_files.load_sibling(__file__, name)


def _parse(arg: str | None) -> dict:
  keys = {"model": "small", "gpus": "8", "dp": "8", "pp": "1", "method": "noloco", "data": "c4", "pp_as": "stages"}
  opts = dict(keys, smoke=False)
  for part in (arg or "").split(","):
    if not part:
      continue
    key, eq, value = part.partition("=")
    if key == "smoke" and not eq:
      opts["smoke"] = True
    elif key in keys and eq:
      opts[key] = value
    else:
      raise ValueError(f"configs/paper.py: unknown argument {part!r}; valid: "
                       f"{', '.join(k + '=...' for k in keys)}, smoke.")
  for key in ("gpus", "dp", "pp"):
    opts[key] = int(opts[key])
  if opts["model"] not in SIZES:
    raise ValueError(f"configs/paper.py: model={opts['model']!r}; valid: {sorted(SIZES)}.")
  if opts["method"] not in METHODS:
    raise ValueError(f"configs/paper.py: method={opts['method']!r}; valid: {METHODS}.")
  if opts["data"] not in DATASETS:
    raise ValueError(f"configs/paper.py: data={opts['data']!r}; valid: {DATASETS}.")
  if opts["pp_as"] not in ("stages", "fsdp"):
    raise ValueError(f"configs/paper.py: pp_as={opts['pp_as']!r}; valid: stages, fsdp.")
  if opts["gpus"] % (opts["dp"] * opts["pp"]):
    raise ValueError(f"configs/paper.py: gpus={opts['gpus']} is not a multiple of dp × pp = "
                     f"{opts['dp']} × {opts['pp']}.")
  return opts


def run_name(model: str, gpus: int, dp: int, pp: int, method: str, data: str, smoke: bool = False,
             pp_as: str = "stages") -> str:
  """What the run is, e.g. `small-16gpu-dp8-pp2-noloco-c4`: a workdir or plot label."""
  layout = "" if pp_as == "stages" or pp == 1 else "-ppfsdp"
  return f"{model}-{gpus}gpu-dp{dp}-pp{pp}{layout}-{method}-{data}" + ("-smoke" if smoke else "")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  o = _parse(arg)
  size = SIZES[o["model"]]
  data_config = _sibling(o["data"])
  config = data_config.get_config("llama3" if o["data"] == "c4" else None)

  config.num_steps = 25_000
  config.num_replicas = o["dp"]
  config.num_devices = 0  # every replica group on its own devices: DP groups of GPUs / DP devices
  if o["pp_as"] == "stages":  # PP = pipeline stages, as in the paper
    config.num_stages = o["pp"]
    config.fsdp = o["gpus"] // (o["dp"] * o["pp"])
  else:  # pp_as=fsdp: a replica's GPUs / DP devices all go to fsdp
    config.num_stages = 1
    config.fsdp = o["gpus"] // o["dp"]
  stages = config.num_stages

  config.model.preset = o["model"]
  config.model.vocab_size = VOCAB[o["data"]]
  config.model.dtype = "bfloat16"  # bf16 matmuls and activations
  config.model.param_dtype = "float32"  # float32 master weights (cast to bf16 where they are used)
  config.model.remat = size["remat"]

  config.data.seq_len = SEQ_LEN
  # Global batch tokens / (replicas × sequence length) sequences per replica per inner step.
  config.data.batch_size = size["batch_tokens"] // (o["dp"] * SEQ_LEN)
  # About 1M validation tokens per evaluation whatever the per-replica batch.
  config.data.eval_batches = max(1, 2 ** 20 // (config.data.batch_size * SEQ_LEN))
  if stages > 1:
    # One sequence per micro-batch, as the reference pipeline.
    config.pipeline.microbatches = 0
  else:
    # Without stages: accumulate gradients over slices of `device_seqs` sequences per device.
    per_device = config.data.batch_size // config.fsdp
    config.inner.microbatches = max(1, per_device // size["device_seqs"])

  config.inner.optimizer = "adam"
  config.inner.lr = size["lr"]
  config.inner.warmup_steps = 1000
  config.inner.min_lr_ratio = 0.1
  config.inner.weight_decay = 0.0
  config.inner.grad_clip = 1.0

  config.outer.update(OUTER[o["method"]])
  config.outer.offload = size["offload"] and o["method"] != "ddp"  # ddp keeps no outer state

  if o["smoke"]:
    _shrink(config)
  return config


def _shrink(config: ml_collections.ConfigDict) -> None:
  """Seconds instead of days, on the embedded corpus; the replica × fsdp layout is kept."""
  config.num_steps = 12
  config.eval_every = 6
  config.log_every = 3
  config.checkpoint_every = 0
  config.outer.inner_steps = 3
  config.inner.warmup_steps = 2
  config.model.update(d_model=32, num_layers=config.num_stages, num_heads=2, mlp_dim=64, vocab_size=0)
  config.inner.microbatches = 1
  config.outer.offload = False
  config.data.update(source="stdlib", tokenizer="bytes", mode="", path="", hf_tokenizer="", train_files="",
                     eval_files="", vocab_size=0, eos_id=-1, seq_len=32, eval_batches=1, prefetch=2,
                     batch_size=config.fsdp)  # one sequence per device


def grid_rows() -> tuple[tuple[str, int, int, int], ...]:
  """The results table's rows: (model, GPUs, DP, PP)."""
  return ROWS


def grid() -> list[str]:
  """Every run of the paper's grid as the argument string of this config (48 = 8 rows × 3 × 2)."""
  return [f"model={m},gpus={g},dp={d},pp={p},method={method},data={data}"
          for (m, g, d, p) in ROWS for method in METHODS for data in DATASETS]


def grid_names() -> dict[str, str]:
  """{run name: argument string} for the whole grid."""
  return {run_name(**_parse(arg)): arg for arg in grid()}
