"""Export a checkpoint to the Hugging Face format, for `transformers.LlamaForCausalLM`.

    python -m noloco_jax.export_hf WORKDIR --out DIR [--replica I | --consensus [--source theta]] [--step S] [--force]

writes DIR/config.json, DIR/model.safetensors and, where the run used a tokenizer, its files
(docs/after_a_run.md says which for each tokenizer). The checkpoint is read on the host and verified as a
resume verifies it (io/checkpoint/read.py): no mesh, no training set-up, no accelerator; a latest step
that fails verification is skipped with a warning naming it. WORKDIR may be an asynchronous job's: its
processes' checkpoints are read together (asynchronous/result.py; `--consensus` is then their
progress-weighted average, `--replica I` process I's replica).

What DIR may hold (`check_out`), the tokenizer files and the provenance entry: docs/after_a_run.md.

Why the weights map one to one: our Llama (models/llama.py) is the Hugging Face Llama (pre-norm RMSNorm,
rotary pairs (i, i + K/2) as `rotate_half`, so q and k need no permutation; SwiGLU; untied; no biases).
Only layouts differ: Flax kernels are [in, out] (torch: [out, in]), q/k/v are [D, H, K] and o [H, K, D],
and the layers are stacked [num_layers, ...] (nn.scan). `hf_state_dict` is that mapping, a pure function
of one replica's params. A model field without a mapping is refused in one line (`check_exportable`);
training-only fields (remat, attention kernel, loss_chunk) do not change the function. safetensors is
written directly (header length, JSON header, raw little-endian tensors): no torch needed to export.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import noloco_jax
from noloco_jax.asynchronous import logs as async_logs
from noloco_jax.asynchronous import result as async_result
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.io.data import tokenizer as tokenizer_lib
from noloco_jax.models.base import DTYPES
from noloco_jax.models import llama

# config.model fields and what becomes of them in the export. Anything else in config.model is refused.
MAPPED_FIELDS = {
    "arch": "must be 'llama' (LlamaForCausalLM)",
    "preset": "its sizes become hidden_size, num_hidden_layers, num_attention_heads, intermediate_size",
    "d_model": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads (= num_key_value_heads)",
    "mlp_dim": "intermediate_size", "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "param_dtype": "the weights' dtype (default of --dtype)",
    "dtype": "none: transformers computes in the weights' dtype",
    "remat": "training only", "remat_policy": "training only", "attention": "training only (the kernel, not the function)",
    "loss_chunk": "training only (the loss, not the logits)",
}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Every file an export may write: a folder holding only these and our config.json is a previous export.
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# What marks a run's workdir (or an asynchronous job's): never written into (its config.json is the run's).
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "run.lock", "summary.json", "checkpoints_corrupt")


class ExportError(ValueError):
  """The run cannot be exported as asked; the message is one line naming the field and value."""


def check_exportable(config) -> None:
  """Refuses, in one line, a model this exporter cannot write as LlamaForCausalLM."""
  model = config.model
  if model.arch != "llama":
    raise ExportError(f"config.model.arch={model.arch!r} has no Hugging Face equivalent here; only 'llama' exports "
                      "(LlamaForCausalLM).")
  unknown = sorted(set(model.keys()) - set(MAPPED_FIELDS))
  if unknown:
    raise ExportError(f"config.model.{unknown[0]}={model[unknown[0]]!r} has no known Hugging Face mapping "
                      f"(export_hf.MAPPED_FIELDS lists the fields that export); it cannot be exported as LlamaForCausalLM.")


def llama_config(config, params) -> llama.LlamaConfig:
  """The run's LlamaConfig, its vocabulary read from the weights (the tokenizer's files are not needed)."""
  vocab = int(np.shape(params["embed"]["embedding"])[0])
  return llama.resolve_config(config.model, vocab_size=vocab, seq_len=config.data.seq_len)


def hf_state_dict(params) -> dict[str, np.ndarray]:
  """One replica's Flax params (models/llama.py) -> LlamaForCausalLM's state dict, as NumPy arrays."""
  blocks = params["layers"]["blocks"]
  num_layers, d_model = np.shape(blocks["attn"]["q"]["kernel"])[:2]
  out = {"model.embed_tokens.weight": params["embed"]["embedding"],
         "model.norm.weight": params["final_norm"]["scale"],
         "lm_head.weight": np.transpose(params["head"]["kernel"])}  # [D, V] -> [V, D]
  for i in range(num_layers):
    layer = _layer(blocks, i)
    pre = f"model.layers.{i}."
    for name in ("q", "k", "v"):  # [D, H, K] -> [H·K, D]
      kernel = layer["attn"][name]["kernel"]
      out[pre + f"self_attn.{name}_proj.weight"] = np.reshape(kernel, (d_model, -1)).T
    out[pre + "self_attn.o_proj.weight"] = np.reshape(layer["attn"]["o"]["kernel"], (-1, d_model)).T  # [H, K, D] -> [D, H·K]
    for name in ("gate", "up", "down"):  # [in, out] -> [out, in]
      out[pre + f"mlp.{name}_proj.weight"] = np.transpose(layer["mlp"][name]["kernel"])
    out[pre + "input_layernorm.weight"] = layer["attn_norm"]["scale"]
    out[pre + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
  return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def _layer(tree, i: int):
  """Layer i of a tree of stacked [num_layers, ...] arrays (plain dict walk: host arrays, no jax)."""
  if isinstance(tree, dict):
    return {k: _layer(v, i) for k, v in tree.items()}
  return np.asarray(tree)[i]


def hf_config(cfg: llama.LlamaConfig, *, dtype: str, eos_id: int | None, provenance: dict) -> dict[str, Any]:
  """config.json of LlamaForCausalLM for `cfg`. The separator that ends every document also starts the
  next one in our packed sequences, so it is both the beginning- and end-of-sequence token."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      # rope_theta for transformers 4.x, rope_parameters for 5.x: the same plain RoPE, no scaling.
      "rope_theta": cfg.rope_theta, "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
      "initializer_range": 0.02, "use_cache": True, "pretraining_tp": 1,
      "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
      "torch_dtype": dtype, "dtype": dtype,
      "noloco_jax": provenance,
  }


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> int:
  """Writes the safetensors format: u64 header size, JSON header (dtype, shape, byte offsets), raw data.
  Returns the file's size in bytes."""
  header, offset, names = {}, 0, sorted(tensors)
  for name in names:
    a = tensors[name]
    kind = SAFETENSORS_DTYPES.get(np.dtype(a.dtype).name)
    if kind is None:
      raise ExportError(f"tensor {name}: dtype {a.dtype} has no safetensors code here; valid: {', '.join(SAFETENSORS_DTYPES)}.")
    header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  if metadata:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in names:
      a = np.ascontiguousarray(tensors[name])
      f.write((a.byteswap() if sys.byteorder == "big" else a).tobytes())  # safetensors is little-endian
  return 8 + len(blob) + offset


# ---- tokenizer files ----


def byte_to_unicode() -> dict[int, str]:
  """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes for
  the code points from 256 on, in byte order (the alphabet `tokenizers`' ByteLevel pre-tokenizer uses)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def write_byte_tokenizer(out: str, eos_id: int) -> list[str]:
  """Our byte tokenizer (ids 0–255 = UTF-8 bytes, 256 = the separator) as a `tokenizers` tokenizer.json:
  byte-level BPE with no merges, byte b ↦ id b, and the separator as the special token <|endoftext|>."""
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top  (the `export` extra)
  except ImportError as e:
    raise ExportError("writing the byte tokenizer's tokenizer.json needs the `tokenizers` package: "
                      "pip install '.[export]' (or --no-tokenizer to write the model only).") from e
  vocab = {ch: b for b, ch in byte_to_unicode().items()}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True, normalized=False)])
  if tok.token_to_id("<|endoftext|>") != eos_id:
    raise ExportError(f"byte tokenizer: the separator got id {tok.token_to_id('<|endoftext|>')}, expected {eos_id}.")
  tok.save(os.path.join(out, "tokenizer.json"))
  return ["tokenizer.json"]


def write_tokenizer(config, out: str) -> tuple[list[str], int | None, str]:
  """(files written, separator id or None, a sentence saying what was written) for the run's tokenizer."""
  data = config.data
  eos = None
  if data.tokenizer == "bytes":
    eos = tokenizer_lib.ByteTokenizer.eos_id
    files = write_byte_tokenizer(out, eos)
    cls, note = "PreTrainedTokenizerFast", ("tokenizer.json: the byte tokenizer as byte-level BPE without merges "
                                            "(byte b = id b, <|endoftext|> = 256)")
  elif data.tokenizer == "sentencepiece":
    tok = tokenizer_lib.SentencePieceTokenizer(data.spm_model)
    eos = tok.eos_id
    shutil.copyfile(os.path.expanduser(data.spm_model), os.path.join(out, "tokenizer.model"))
    files, cls = ["tokenizer.model"], "LlamaTokenizer"
    note = f"tokenizer.model: a copy of {data.spm_model}"
  elif data.tokenizer == "hf":
    tok = tokenizer_lib.HFTokenizer(data.hf_tokenizer, data.eos_id)
    eos = tok.eos_id
    src = data.hf_tokenizer
    local = os.path.join(src, "tokenizer.json") if os.path.isdir(src) else src
    if os.path.isfile(local):
      shutil.copyfile(local, os.path.join(out, "tokenizer.json"))
    else:  # a hub name: the `tokenizers` package fetches and saves it
      import tokenizers  # pylint: disable=g-import-not-at-top
      tokenizers.Tokenizer.from_pretrained(src, token=os.environ.get("HF_TOKEN") or None).save(
          os.path.join(out, "tokenizer.json"))
    files, cls = ["tokenizer.json"], "PreTrainedTokenizerFast"
    note = f"tokenizer.json: {src}"
  else:  # pretokenized: ids only, no vocabulary to write
    return [], data.eos_id if data.eos_id >= 0 else None, "no tokenizer files: the run read pre-tokenized ids"
  special = "<|endoftext|>" if data.tokenizer == "bytes" else None
  tok_config = {"tokenizer_class": cls, "model_max_length": int(config.model.max_seq_len or data.seq_len),
                "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
  if special:
    tok_config.update(bos_token=special, eos_token=special, pad_token=special)
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(tok_config, f, indent=2)
  return files + ["tokenizer_config.json"], eos, note


# ---- where it goes, and where it comes from ----


def _is_previous_export(out: str, names: list[str]) -> bool:
  if not set(names) <= set(EXPORT_FILES) or "config.json" not in names:
    return False
  try:
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
      return "noloco_jax" in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


def check_out(workdir: str, out: str, force: bool = False) -> bool:
  """Raises ExportError (one line) unless `out` may receive an export; returns whether it holds a previous
  export of ours, to be replaced. Never a run's workdir; a non-empty folder of anything else only with `force`."""
  target, run = os.path.realpath(os.path.expanduser(out)), os.path.realpath(os.path.expanduser(workdir))
  if os.path.exists(target) and not os.path.isdir(target):
    raise ExportError(f"--out={out!r} is a file, not a folder: give a new or empty folder.")
  names = sorted(os.listdir(target)) if os.path.isdir(target) else []
  markers = [n for n in names if n in RUN_MARKERS or async_logs.PROCESS_DIR.fullmatch(n)]
  if target == run or markers:
    raise ExportError(f"--out={out!r} is the workdir of a run (it holds {', '.join(markers) or 'its checkpoints'}): "
                      "an export there would replace the run's own config.json; give a folder of its own, e.g. "
                      f"--out={os.path.join(out, 'hf')!r} (refused even with --force).")
  if not names:
    return False
  if _is_previous_export(target, names):
    return True
  if not force:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise ExportError(f"--out={out!r} is not empty and is not an export of noloco_jax (it holds {shown}): nothing "
                      "was written; give a new or empty folder, or --force to replace its files of an export's "
                      f"names ({', '.join(EXPORT_FILES)}).")
  return False


def _commit() -> str | None:
  """The git commit of this code, where it runs from a git checkout (None elsewhere, e.g. an installed wheel)."""
  try:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(noloco_jax.__file__)),
                          capture_output=True, text=True, timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip() if done.returncode == 0 else None


def without_paths(value):
  """A config (any JSON value) with every filesystem path cut to its last part: `/data/c4_spm.model` ->
  `c4_spm.model`, `/data/books/*.txt` -> `*.txt`. Names that are not paths (a hub name such as
  `meta-llama/Meta-Llama-3-8B`) stay: a path starts with /, ~, ./ or ../ (each of a comma-separated list)."""
  if isinstance(value, dict):
    return {k: without_paths(v) for k, v in value.items()}
  if isinstance(value, list):
    return [without_paths(v) for v in value]
  if isinstance(value, str) and value.startswith(("/", "~", "./", "../")):
    return ",".join(os.path.basename(part.rstrip("/")) for part in value.split(","))
  return value


def provenance(snap, which: str, source: str) -> dict[str, Any]:
  """Where the exported weights come from, for config.json: no path of this machine (`without_paths`)."""
  out = {"step": snap.step, "weights": which, "source": source, "num_replicas": snap.num_replicas,
         "outer_kind": snap.config.outer.kind, "config": without_paths(snap.config.to_dict()),
         "code": {"noloco_jax": noloco_jax.__version__, "commit": _commit()}}
  if isinstance(snap, async_result.JobSnapshot):
    out["asynchronous_job"] = {"checkpoint_steps": {str(k): v for k, v in snap.steps.items()},
                               "consensus_weights": [float(q) for q in snap.consensus_weights()]}
  return out


def _move_in(tmp: str, out: str, written: list[str], replace_previous: bool) -> None:
  """The files of `tmp` into `out` (created if missing); a previous export's files that this one does not
  write are removed (a stale tokenizer.model beside a new tokenizer.json would mislead a loader)."""
  os.makedirs(out, exist_ok=True)
  if replace_previous:
    for name in set(EXPORT_FILES) - set(written):
      path = os.path.join(out, name)
      if os.path.exists(path):
        os.remove(path)
  for name in written:
    os.replace(os.path.join(tmp, name), os.path.join(out, name))


# ---- the export ----


def export(workdir: str, out: str, *, replica: int | None = None, consensus: bool = False, source: str = "slow",
           step: int | None = None, dtype: str | None = None, tokenizer: bool = True, force: bool = False,
           warn=None) -> dict[str, Any]:
  """Writes the export of one replica (default 0) or the consensus model; returns what was written.

  `warn(line)` receives the warnings (newer checkpoints that failed verification; default: ignored)."""
  start = time.perf_counter()
  replace_previous = check_out(workdir, out, force)
  snap = async_result.read(workdir, step, slow=consensus)
  for line in async_result.warnings(snap):
    (warn or (lambda _: None))(line)
  check_exportable(snap.config)
  params = snap.weights(replica, consensus=consensus, source=source)
  cfg = llama_config(snap.config, params)
  dtype = dtype or snap.config.model.param_dtype
  if dtype not in SAFETENSORS_DTYPES or dtype not in DTYPES:
    raise ExportError(f"--dtype={dtype!r}; valid: {', '.join(d for d in SAFETENSORS_DTYPES if d in DTYPES)}.")
  parent = os.path.dirname(os.path.abspath(os.path.expanduser(out)))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".export_hf-", dir=parent) as tmp:
    files, eos, note = write_tokenizer(snap.config, tmp) if tokenizer else ([], None, "no tokenizer files (--no-tokenizer)")
    if eos is None and snap.config.data.tokenizer == "bytes":
      eos = tokenizer_lib.ByteTokenizer.eos_id
    which = "consensus" if consensus else f"replica {0 if replica is None else replica}"
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config(cfg, dtype=dtype, eos_id=eos, provenance=provenance(snap, which, source if consensus else "theta")),
                f, indent=2)
    tensors = {k: v.astype(DTYPES[dtype]) for k, v in hf_state_dict(params).items()}
    size = write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
    written = ["config.json", "model.safetensors"] + files
    _move_in(tmp, out, written, replace_previous)
  return {"out": os.path.abspath(out), "step": snap.step, "weights": which, "dtype": dtype,
          "files": written, "tokenizer": note, "bytes": size, "seconds": time.perf_counter() - start,
          "replaced": replace_previous}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m noloco_jax.export_hf", description=__doc__.split("\n")[0])
  p.add_argument("workdir", help="the run's --workdir (it holds checkpoints/)")
  p.add_argument("--out", required=True, help="the directory to write (created if missing)")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--replica", type=int, default=None, help="export replica I's θ (default: replica 0)")
  which.add_argument("--consensus", action="store_true", help="export the replicas' average (outer/consensus.py)")
  p.add_argument("--source", choices=("slow", "theta"), default="slow",
                 help="with --consensus: average the slow weights φ (default) or θ")
  p.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")
  p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the run's model.param_dtype)")
  p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false", help="write the model files only")
  p.add_argument("--force", action="store_true", help="write into a non-empty --out that is not an export of ours, "
                 "replacing its files of an export's names (never a run's workdir)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  warn = lambda line: print(f"noloco_jax.export_hf: warning: {line}", file=sys.stderr)
  try:
    done = export(args.workdir, args.out, replica=args.replica, consensus=args.consensus, source=args.source,
                  step=args.step, dtype=args.dtype, tokenizer=args.tokenizer, force=args.force, warn=warn)
  except (ExportError, read_lib.CheckpointReadError) as e:
    print(f"noloco_jax.export_hf: error: {e}", file=sys.stderr)
    return 2
  print(f"Exported {done['weights']} of step {done['step']} ({done['dtype']}, {done['bytes'] / 2**20:.1f} MiB) to "
        f"{done['out']}{' (replacing the previous export there)' if done['replaced'] else ''} in "
        f"{done['seconds']:.1f} s: {', '.join(done['files'])}. {done['tokenizer']}.")
  print(f"Load it with: transformers.AutoModelForCausalLM.from_pretrained({done['out']!r})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
