"""Sampling from a checkpoint (noloco_jax/sample.py): the filters against NumPy, the draws' statistics,
greedy decoding against the model run on the whole prefix, seeding, and the command line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import sample
from noloco_jax.models import llama

from checkpoint_damage import copy_run, damage


def _filter_reference(logits, top_k, top_p):
  out = np.array(logits, np.float64)
  for row in out:
    order = np.argsort(-row, kind="stable")
    keep = np.ones(row.shape, bool)
    if top_k > 0:
      keep &= row >= row[order[top_k - 1]]
    if top_p < 1:
      p = np.exp(row[order] - row[order].max())
      p /= p.sum()
      before = np.cumsum(p) - p
      kept = order[before < top_p]
      keep &= row >= row[kept].min()
    row[~keep] = -np.inf
  return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.95), (4, 0.7), (50, 0.01)])
def test_filter_logits_against_numpy(top_k, top_p):
  logits = np.random.default_rng(top_k * 10 + int(top_p * 100)).normal(size=(6, 50)).astype(np.float32) * 2
  got = np.asarray(sample.filter_logits(logits, top_k, top_p))
  want = _filter_reference(logits, top_k, top_p)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
  assert np.isfinite(got).any(axis=-1).all()  # never an empty set


def test_draws_follow_the_filtered_tempered_distribution():
  # 40,000 seeded draws from one row: frequencies within 5 standard errors of softmax(filtered / T).
  logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
  t, k, p = 0.7, 6, 0.95
  n = 40_000
  draws = np.asarray(sample.next_tokens(jax.random.key(0), np.broadcast_to(logits, (n, 8)), t, k, p))
  filtered = _filter_reference(logits[None], k, p)[0] / t
  want = np.exp(filtered - filtered.max())
  want /= want.sum()
  freq = np.bincount(draws, minlength=8) / n
  se = np.sqrt(want * (1 - want) / n) + 1e-12
  assert np.all(np.abs(freq - want) <= 5 * se + 1e-9), (freq, want)
  assert freq[want == 0].sum() == 0  # nothing outside the kept set


def _tiny_model(max_seq_len=16):
  cfg = llama.LlamaConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=2, mlp_dim=64, max_seq_len=max_seq_len)
  model = llama.LlamaModel(cfg)
  params = model.init(jax.random.key(1), jnp.zeros((1, max_seq_len), jnp.int32))
  # Sharper logits than at initialisation, so that greedy choices are not near-ties.
  params["head"]["kernel"] = params["head"]["kernel"] * 40
  return model, params


def test_greedy_decoding_equals_the_argmax_of_the_model_on_the_whole_prefix_with_a_sliding_window():
  model, params = _tiny_model(max_seq_len=16)
  prompt = [3, 7, 11, 2, 5]
  got = sample.generate(model, params, prompt, length=14, temperature=0.0)  # 19 tokens > 16: the window slides
  seq = list(prompt)
  apply = jax.jit(model.apply)  # the model on each whole window (one compile per window length, not op by op)
  for _ in range(14):
    window = np.asarray(seq[-16:], np.int32)[None]
    seq.append(int(np.argmax(np.asarray(apply(params, window))[0, -1])))
  assert got.tolist() == [seq[len(prompt):]]


def test_sampling_is_seeded_and_stops_at_the_separator():
  model, params = _tiny_model()
  a = sample.generate(model, params, [1, 2, 3], length=12, temperature=1.0, seed=4, num_samples=3)
  b = sample.generate(model, params, [1, 2, 3], length=12, temperature=1.0, seed=4, num_samples=3)
  c = sample.generate(model, params, [1, 2, 3], length=12, temperature=1.0, seed=5, num_samples=3)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  assert len({tuple(r) for r in a.tolist()}) > 1  # the samples of one call differ from each other
  first = int(a[0, 0])
  stopped = sample.generate(model, params, [1, 2, 3], length=12, temperature=1.0, seed=4, num_samples=1, stop_id=first)
  assert stopped.tolist() == [[first]]


def test_the_command_line_samples_a_checkpoint(finished_run, capsys):
  assert sample.main([finished_run, "--consensus", "--prompt", "def ", "--length", "24", "--seed", "1",
                      "--num-samples", "2", "--top-k", "20"]) == 0
  out = capsys.readouterr().out
  assert out.count("----- sample ") == 2 and "(consensus, step 12, seed 1)" in out and "def " in out
  done = sample.sample(finished_run, prompt="import ", length=16, replica=2, step=6, seed=1, temperature=0.0,
                       stop_at_eos=False)
  assert done["weights"] == "replica 2" and done["step"] == 6 and done["ids"].shape == (1, 16)
  assert done["prompt_ids"] == list(b"import ")
  assert done["texts"][0] == bytes(i for i in done["ids"][0] if i < 256).decode("utf-8", errors="replace")


@pytest.mark.parametrize("args,message", [
    (["--prompt", "x", "--top-p", "0"], "--top-p=0.0 is not valid: a number in (0, 1] (1 = off)."),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p=1.5 is not valid: a number in (0, 1] (1 = off)."),
    (["--prompt", "x", "--temperature", "-1"], "--temperature=-1.0 is not valid: a number >= 0 (0 = greedy)."),
    (["--prompt", "x", "--temperature", "nan"], "--temperature=nan is not valid"),
    (["--prompt", "x", "--top-k", "-2"], "--top-k=-2 is not valid: an integer >= 0 (0 = off)."),
    (["--prompt", "x", "--length", "0"], "--length=0 is not valid: an integer >= 1."),
    (["--prompt", "x", "--num-samples", "0"], "--num-samples=0 is not valid: an integer >= 1."),
    (["--prompt-ids", "1,x"], "--prompt-ids='1,x': give comma-separated integers"),
    (["--prompt-ids", "999"], "--prompt-ids: 999 is outside the vocabulary [0, 257)."),
    (["--prompt", "x", "--replica", "9"], "--replica=9: the checkpoint of step 12 holds replicas 0 to 7."),
])
def test_bad_arguments_are_one_line(finished_run, capsys, args, message):
  assert sample.main([finished_run] + args) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("noloco_jax.sample: error: ") and message in err and "\n" not in err, err
  # The line names the argument that is wrong, and no argument that is right.
  wrong = message.split("=")[0].split(":")[0]
  named = set(re.findall(r"--[a-z-]+", err))
  assert named <= {wrong}, (named, err)


def test_a_damaged_latest_step_is_skipped_with_a_warning_naming_it(finished_run, tmp_path, capsys):
  """Issue 33 item 4: the sampler read the latest step without its checksums."""
  workdir = copy_run(finished_run, tmp_path)
  damage(workdir, 12, "state")
  assert sample.main([workdir, "--prompt", "def ", "--length", "4", "--replica", "5"]) == 0
  captured = capsys.readouterr()
  (warning,) = captured.err.strip().splitlines()
  assert warning.startswith(f"noloco_jax.sample: warning: checkpoint step(s) 12 of {workdir} fail verification")
  assert "----- sample 0 (replica 5, step 6, seed 0) -----" in captured.out
  damage(workdir, 6, "state")
  assert sample.main([workdir, "--prompt", "def ", "--length", "4"]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and f"WORKDIR={workdir!r}: no valid checkpoint in" in err, err
