"""Text from a checkpoint: the first sanity check of a trained language model.

    python -m noloco_jax.sample WORKDIR [--replica I | --consensus] [--step S] --prompt "def " \
        [--length 200] [--temperature 0.8] [--top-k 0] [--top-p 1.0] [--seed 0] [--num-samples 1]

The weights are read on the host and verified as a resume verifies them (io/checkpoint/read.py; a latest
step that fails is skipped with a warning naming it): one replica's θ or the consensus model
(outer/consensus.py); WORKDIR may be an asynchronous job's (asynchronous/result.py: `--replica I` is
process I's replica, `--consensus` the processes' progress-weighted average). The prompt is encoded and
the output decoded with the run's own tokenizer (config.data.tokenizer; a pre-tokenized run takes
--prompt-ids and prints ids).

No KV cache (docs/after_a_run.md): every new token re-runs the model over a fixed [num_samples, W]
window (W = prompt + length, at most max_seq_len), so one program is compiled; causal attention makes the
logits at position p independent of the padding after it; past max_seq_len the window slides. Sampling
is seeded (each new token folds its index into the key); temperature 0 is greedy; --top-k and --top-p
together keep their intersection.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax import models
from noloco_jax.asynchronous import result as async_result
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.io.data import tokenizer as tokenizer_lib


class SampleError(ValueError):
  """Bad arguments for sampling; the message is one line naming the argument."""


def filter_logits(logits_SxV, top_k, top_p):
  """Logits with -inf outside the top-k tokens (top_k > 0) and outside the top-p nucleus (top_p < 1).

  The nucleus is the smallest set of most likely tokens whose probability reaches top_p (the most
  likely token always stays). Ties at a threshold are kept. Traced values are fine: one program for
  every (top_k, top_p).
  """
  logits = jnp.asarray(logits_SxV, jnp.float32)
  v = logits.shape[-1]
  desc = -jnp.sort(-logits, axis=-1)
  kth = jax.lax.dynamic_index_in_dim(desc, jnp.clip(jnp.asarray(top_k) - 1, 0, v - 1), axis=-1)  # [S, 1]
  keep = jnp.where(jnp.asarray(top_k) > 0, logits >= kth, True)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens more likely than each
  in_nucleus = before < top_p
  last = jnp.sum(in_nucleus, axis=-1, keepdims=True) - 1  # index (in desc order) of the least likely kept
  threshold = jnp.take_along_axis(desc, jnp.maximum(last, 0), axis=-1)
  keep &= jnp.where(jnp.asarray(top_p) < 1.0, logits >= threshold, True)
  return jnp.where(keep, logits, -jnp.inf)


def next_tokens(key, logits_SxV, temperature, top_k, top_p):
  """One token per row: argmax when temperature == 0, else a draw from softmax(filtered logits / T)."""
  filtered = filter_logits(logits_SxV, top_k, top_p)
  t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
  drawn = jax.random.categorical(key, filtered / t, axis=-1)
  return jnp.where(jnp.asarray(temperature) > 0, drawn, jnp.argmax(logits_SxV, axis=-1)).astype(jnp.int32)


def generate(model, params, prompt_ids, *, length: int, temperature: float = 0.8, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, num_samples: int = 1, stop_id: int | None = None) -> np.ndarray:
  """[num_samples, ≤ length] new token ids after `prompt_ids`, re-running the window for each token."""
  prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
  if not len(prompt):
    raise SampleError("the prompt is empty: give at least one token (--prompt, or --prompt-ids).")
  window = min(model.max_seq_len, len(prompt) + length)
  buf = np.zeros((num_samples, window), np.int32)
  context = prompt[-window:]
  buf[:, :len(context)] = context
  pos = len(context) - 1  # the last filled position: its logits give the next token

  @jax.jit
  def step(params, buf_SxW, pos, key, temperature, top_k, top_p):
    logits_SxV = jax.lax.dynamic_index_in_dim(model.apply(params, buf_SxW), pos, axis=1, keepdims=False)
    return next_tokens(key, logits_SxV, temperature, top_k, top_p)

  key = jax.random.key(seed)
  out = np.zeros((num_samples, length), np.int32)
  done = np.zeros(num_samples, bool)
  for i in range(length):
    token = np.asarray(step(params, buf, pos, jax.random.fold_in(key, i), temperature, top_k, top_p))
    out[:, i] = token
    if stop_id is not None:
      done |= token == stop_id
      if done.all():
        return out[:, :i + 1]
    if pos + 1 < window:
      pos += 1
      buf[:, pos] = token
    else:  # the window is full: slide it by one
      buf = np.concatenate([buf[:, 1:], token[:, None]], axis=1)
  return out


def _vocab_size(config, tokenizer) -> int:
  return int(config.model.vocab_size or tokenizer.vocab_size)


def check_arguments(*, length: int, num_samples: int, temperature: float, top_k: int, top_p: float) -> None:
  """SampleError naming the first argument out of its range (only that one), its value and what is valid."""
  ranges = (("--length", length, length >= 1, "an integer >= 1"),
            ("--num-samples", num_samples, num_samples >= 1, "an integer >= 1"),
            ("--temperature", temperature, temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("--top-k", top_k, top_k >= 0, "an integer >= 0 (0 = off)"),
            ("--top-p", top_p, 0 < top_p <= 1, "a number in (0, 1] (1 = off)"))
  for name, value, ok, valid in ranges:
    if not ok:  # NaN fails every comparison: refused too
      raise SampleError(f"{name}={value} is not valid: {valid}.")


def sample(workdir: str, *, prompt: str | None = None, prompt_ids: list[int] | None = None, length: int = 200,
           temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
           replica: int | None = None, consensus: bool = False, source: str = "slow", step: int | None = None,
           stop_at_eos: bool = True, warn=None) -> dict:
  """{"texts": decoded completions, "ids": their ids, "prompt_ids", "step", "weights", "seconds"}.

  `warn(line)` receives the warnings (newer checkpoints that failed verification; default: ignored)."""
  check_arguments(length=length, num_samples=num_samples, temperature=temperature, top_k=top_k, top_p=top_p)
  start = time.perf_counter()
  snap = async_result.read(workdir, step, slow=consensus)
  for line in async_result.warnings(snap):
    (warn or (lambda _: None))(line)
  params = snap.weights(replica, consensus=consensus, source=source)
  tok = tokenizer_lib.make_tokenizer(snap.config.data)
  if prompt_ids is None:
    if prompt is None:
      raise SampleError("give --prompt TEXT (or --prompt-ids 1,2,3).")
    if snap.config.data.tokenizer == "pretokenized":
      raise SampleError("--prompt: this run read pre-tokenized ids and has no tokenizer to encode text; "
                        "give --prompt-ids 1,2,3.")
    prompt_ids = tok.encode(prompt).tolist()
  model = models.get(snap.config.model.arch).resolve(snap.config.model, vocab_size=_vocab_size(snap.config, tok),
                                                     seq_len=snap.config.data.seq_len)
  bad = [i for i in prompt_ids if not 0 <= i < model.vocab_size]
  if bad:
    raise SampleError(f"--prompt-ids: {bad[0]} is outside the vocabulary [0, {model.vocab_size}).")
  ids = generate(model, params, prompt_ids, length=length, temperature=temperature, top_k=top_k, top_p=top_p,
                 seed=seed, num_samples=num_samples, stop_id=tok.eos_id if stop_at_eos else None)
  texts = []
  for row in ids:
    row = row.tolist()
    if stop_at_eos and tok.eos_id in row:
      row = row[:row.index(tok.eos_id)]
    texts.append(tok.decode(row))
  which = "consensus" if consensus else f"replica {0 if replica is None else replica}"
  return {"texts": texts, "ids": ids, "prompt_ids": list(prompt_ids), "step": snap.step, "weights": which,
          "seconds": time.perf_counter() - start}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m noloco_jax.sample", description=__doc__.split("\n")[0])
  p.add_argument("workdir", help="the run's --workdir (it holds checkpoints/)")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--replica", type=int, default=None, help="sample from replica I's θ (default: replica 0)")
  which.add_argument("--consensus", action="store_true", help="sample from the replicas' average")
  p.add_argument("--source", choices=("slow", "theta"), default="slow", help="with --consensus: average φ or θ")
  p.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")
  p.add_argument("--prompt", default=None, help="the text to continue")
  p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
  p.add_argument("--length", type=int, default=200, help="new tokens per sample")
  p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the most likely tokens up to probability p (1 = off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1)
  p.add_argument("--no-stop", dest="stop_at_eos", action="store_false",
                 help="do not stop at the end-of-document separator")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    ids = None
    if args.prompt_ids is not None:
      try:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
      except ValueError:
        raise SampleError(f"--prompt-ids={args.prompt_ids!r}: give comma-separated integers, e.g. 256,100,101.") from None
    done = sample(args.workdir, prompt=args.prompt, prompt_ids=ids, length=args.length, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, num_samples=args.num_samples,
                  replica=args.replica, consensus=args.consensus, source=args.source, step=args.step,
                  stop_at_eos=args.stop_at_eos,
                  warn=lambda line: print(f"noloco_jax.sample: warning: {line}", file=sys.stderr))
  except (SampleError, read_lib.CheckpointReadError) as e:
    print(f"noloco_jax.sample: error: {e}", file=sys.stderr)
    return 2
  for i, text in enumerate(done["texts"]):
    print(f"----- sample {i} ({done['weights']}, step {done['step']}, seed {args.seed}) -----")
    print((args.prompt or "") + text)
  print(f"----- {len(done['texts'])} sample(s) of {done['ids'].shape[1]} tokens in {done['seconds']:.1f} s -----")
  return 0


if __name__ == "__main__":
  sys.exit(main())
