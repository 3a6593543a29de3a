"""Export to the Hugging Face format (noloco_jax/export_hf.py).

Three proofs, from the strongest to the one that always runs: transformers itself loads the export and
gives our model's logits (skipped only without transformers/torch); a NumPy forward pass written from
Hugging Face's Llama definition, on the exported tensors, gives them too; and the file holds exactly
the checkpoint's weights of the replica (or the consensus) asked for.
"""

import json
import os

import jax
import numpy as np
import pytest

from noloco_jax import export_hf
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.io.data.tokenizer import ByteTokenizer
from noloco_jax.models import llama

from checkpoint_damage import copy_run, damage
from safetensors_reader import read_safetensors

INSTALL_HINT = ("needs transformers and torch: pip install transformers 'torch==2.13.0' (the CPU wheel is enough; "
                "any torch that transformers accepts works)")
TEXT = "def f(x):\n  return x + 1  # ünïcode ☃ and a tab\t!"


@pytest.fixture(scope="module")
def exported(finished_run, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("hf"))
  done = export_hf.export(finished_run, out, consensus=True)
  return finished_run, out, done


def _our_logits(params, config, tokens):
  model = llama.LlamaModel(export_hf.llama_config(config, params))
  return np.asarray(model.apply(params, np.asarray(tokens, np.int32)))


def _hf_reference_logits(sd, cfg, tokens):
  """Hugging Face's LlamaForCausalLM forward pass (eager attention, float64) on its own state dict."""
  t = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  H, K, eps, theta = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]

  def rms(x, w):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

  def rotate_half(x):
    x1, x2 = x[..., : K // 2], x[..., K // 2:]
    return np.concatenate([-x2, x1], -1)

  B, L = tokens.shape
  inv_freq = 1.0 / theta ** (np.arange(0, K, 2) / K)
  emb = np.concatenate([np.outer(np.arange(L), inv_freq)] * 2, -1)  # [L, K]
  cos, sin = np.cos(emb)[None, :, None], np.sin(emb)[None, :, None]
  x = t["model.embed_tokens.weight"][tokens]
  mask = np.triu(np.full((L, L), -np.inf), 1)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = rms(x, t[p + "input_layernorm.weight"])
    q, k, v = (np.reshape(h @ t[p + f"self_attn.{n}_proj.weight"].T, (B, L, H, K)) for n in "qkv")
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(K) + mask
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhqs,bshk->bqhk", a, v).reshape(B, L, H * K)
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    h = rms(x, t[p + "post_attention_layernorm.weight"])
    g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
  return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def test_the_files_hold_the_consensus_weights_and_a_llama_config(exported):
  workdir, out, done = exported
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  assert done["step"] == 12 and done["weights"] == "consensus"
  snap = read_lib.read(workdir)
  mean_phi = jax.tree.map(lambda x: np.mean(x.astype(np.float64), 0).astype(np.float32), snap.slow)
  sd = read_safetensors(os.path.join(out, "model.safetensors"))
  want = export_hf.hf_state_dict(mean_phi)
  assert sorted(sd) == sorted(want)
  for name in want:
    np.testing.assert_allclose(sd[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["architectures"] == ["LlamaForCausalLM"]
  assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["intermediate_size"]) == (32, 2, 2, 64)
  assert cfg["vocab_size"] == 257 and cfg["eos_token_id"] == 256 and cfg["rope_parameters"]["rope_theta"] == 500.0
  assert not cfg["tie_word_embeddings"] and cfg["noloco_jax"]["step"] == 12
  try:
    from safetensors.numpy import load_file  # the reference reader, where installed
  except ImportError:
    return
  for name, value in load_file(os.path.join(out, "model.safetensors")).items():
    np.testing.assert_array_equal(value, sd[name])


def test_a_replica_and_a_step_are_exported_as_asked(finished_run, tmp_path):
  done = export_hf.export(finished_run, str(tmp_path), replica=3, step=6, tokenizer=False)
  assert (done["step"], done["weights"]) == (6, "replica 3")
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  theta3 = read_lib.read(finished_run, 6).replica(3)
  sd = read_safetensors(os.path.join(tmp_path, "model.safetensors"))
  for name, value in export_hf.hf_state_dict(theta3).items():
    np.testing.assert_array_equal(sd[name], value)
  # bfloat16 on request: the same weights rounded.
  done = export_hf.export(finished_run, str(tmp_path / "bf16"), replica=3, step=6, dtype="bfloat16", tokenizer=False)
  sd16 = read_safetensors(os.path.join(tmp_path, "bf16", "model.safetensors"))
  assert sd16["lm_head.weight"].dtype.name == "bfloat16"
  np.testing.assert_allclose(sd16["lm_head.weight"].astype(np.float32), sd["lm_head.weight"], rtol=1e-2, atol=1e-3)


def test_a_numpy_forward_pass_of_hugging_faces_llama_on_the_export_gives_our_logits(exported):
  workdir, out, _ = exported
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  sd = read_safetensors(os.path.join(out, "model.safetensors"))
  snap = read_lib.read(workdir)
  tokens = ByteTokenizer().encode(TEXT)[None, :32]
  ours = _our_logits(snap.weights(consensus=True), snap.config, tokens)
  np.testing.assert_allclose(ours, _hf_reference_logits(sd, cfg, tokens), rtol=1e-4, atol=1e-5)


def test_transformers_loads_the_export_and_gives_our_logits(exported):
  transformers = pytest.importorskip("transformers", reason=INSTALL_HINT)
  torch = pytest.importorskip("torch", reason=INSTALL_HINT)
  workdir, out, _ = exported
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert type(model).__name__ == "LlamaForCausalLM"
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = tok.encode(TEXT)
  assert ids == ByteTokenizer().encode(TEXT).tolist() and tok.decode(ids) == TEXT
  assert tok.eos_token_id == 256
  snap = read_lib.read(workdir)
  tokens = np.asarray([ids[:32], ids[5:37]], np.int32)  # a batch of two
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, _our_logits(snap.weights(consensus=True), snap.config, tokens), rtol=1e-4, atol=1e-5)


def test_the_byte_tokenizer_file_is_our_byte_tokenizer(exported):
  tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers: pip install '.[export]'")
  tok = tokenizers.Tokenizer.from_file(os.path.join(exported[1], "tokenizer.json"))
  every_byte = bytes(range(256)).decode("latin-1") + "☃ünï"
  ours = ByteTokenizer().encode(every_byte)
  assert tok.encode(every_byte).ids == ours.tolist()
  assert tok.decode(ours.tolist()) == every_byte
  assert len(set(export_hf.byte_to_unicode().values())) == 256


def test_models_without_a_hugging_face_equivalent_are_refused_in_one_line(finished_run):
  config = read_lib.read(finished_run).config
  config.model.arch = "mamba"
  with pytest.raises(export_hf.ExportError, match=r"^config\.model\.arch='mamba' has no Hugging Face equivalent"):
    export_hf.check_exportable(config)
  config.model.arch = "llama"
  with config.unlocked():
    config.model.tie_embeddings = True  # a field added to the model without a mapping here
  with pytest.raises(export_hf.ExportError, match=r"^config\.model\.tie_embeddings=True has no known Hugging Face mapping"):
    export_hf.check_exportable(config)


def test_bad_arguments_are_one_line_errors(finished_run, tmp_path, capsys):
  cases = [(["--replica", "8"], "--replica=8: the checkpoint of step 12 holds replicas 0 to 7."),
           (["--step", "5"], "--step=5: not a checkpoint of"),
           (["--dtype", "int8"], "--dtype='int8'; valid: float32, bfloat16.")]
  for extra, message in cases:
    assert export_hf.main([finished_run, "--out", str(tmp_path / "x")] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("noloco_jax.export_hf: error: ") and message in err and "\n" not in err, err
  assert export_hf.main([str(tmp_path), "--out", str(tmp_path / "y")]) == 2
  assert "holds no checkpoints/ folder" in capsys.readouterr().err


def test_a_sentencepiece_run_exports_its_model_file_and_transformers_decodes_our_ids(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  import ml_collections  # pylint: disable=g-import-not-at-top
  from noloco_jax.io.data.tokenizer import SentencePieceTokenizer  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / "corpus.txt"
  with open(export_hf.__file__, encoding="utf-8") as f:  # some real Python as the corpus
    corpus.write_text(f.read() + TEXT)
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=500, byte_fallback=True,
                                 hard_vocab_limit=False, character_coverage=0.995,
                                 normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0,
                                 eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2)
  config = ml_collections.ConfigDict({"data": {"tokenizer": "sentencepiece", "spm_model": str(tmp_path / "m.model"),
                                               "seq_len": 64}, "model": {"max_seq_len": 0}})
  out = tmp_path / "out"
  out.mkdir()
  files, eos, _ = export_hf.write_tokenizer(config, str(out))
  assert files == ["tokenizer.model", "tokenizer_config.json"] and eos == 1
  assert (out / "tokenizer.model").read_bytes() == (tmp_path / "m.model").read_bytes()
  ours = SentencePieceTokenizer(str(tmp_path / "m.model"))
  ids = ours.encode(TEXT).tolist()
  transformers = pytest.importorskip("transformers", reason=INSTALL_HINT)
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  # Decoding agrees; encoding may not (docs/after_a_run.md: transformers' conversion of the model handles runs of
  # spaces otherwise), which is why docs/after_a_run.md says to encode with sentencepiece and tokenizer.model.
  assert tok.decode(ids) == ours.decode(ids) == TEXT


# ---- what the export reads: verified as a resume verifies it (issue 33 item 4) ----


@pytest.mark.parametrize("how", ["state", "meta"])
def test_a_damaged_latest_step_is_skipped_with_a_warning_naming_it(finished_run, tmp_path, capsys, how):
  """Before: the export read step 12 without its checksums (a flipped state file was exported as it was, an
  edited meta record unnoticed; other damage ended in a 55-line traceback)."""
  workdir = copy_run(finished_run, tmp_path)
  damage(workdir, 12, how)
  assert export_hf.main([workdir, "--out", str(tmp_path / "hf"), "--consensus"]) == 0
  captured = capsys.readouterr()
  (warning,) = captured.err.strip().splitlines()
  assert warning.startswith(f"noloco_jax.export_hf: warning: checkpoint step(s) 12 of {workdir} fail verification"), warning
  assert "read step 6 instead, the newest valid one" in warning
  assert "Exported consensus of step 6" in captured.out
  with open(tmp_path / "hf" / "config.json") as f:
    assert json.load(f)["noloco_jax"]["step"] == 6
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "6"]  # a reader moves nothing


def test_a_damaged_step_asked_for_or_no_valid_step_is_one_line(finished_run, tmp_path, capsys):
  workdir = copy_run(finished_run, tmp_path)
  damage(workdir, 12, "state")
  assert export_hf.main([workdir, "--out", str(tmp_path / "a"), "--step", "12"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("noloco_jax.export_hf: error: --step=12: checkpoint step 12 in ") and "\n" not in err, err
  damage(workdir, 6, "meta")
  assert export_hf.main([workdir, "--out", str(tmp_path / "b")]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith(f"noloco_jax.export_hf: error: WORKDIR={workdir!r}: no valid checkpoint in "), err
  assert "step(s) 12, 6 all fail verification" in err
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


# ---- where the export goes: nothing is destroyed (issue 33 item 1) ----


def test_the_export_never_writes_into_a_runs_workdir(finished_run, tmp_path, capsys):
  workdir = copy_run(finished_run, tmp_path)
  with open(os.path.join(workdir, "config.json")) as f:
    before = f.read()
  for extra in ([], ["--force"]):
    assert export_hf.main([workdir, "--out", workdir] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"noloco_jax.export_hf: error: --out={workdir!r} is the workdir of a run") and "\n" not in err
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == before
  assert not os.path.exists(os.path.join(workdir, "model.safetensors"))


def test_a_folder_that_is_not_an_export_is_refused_unless_forced(finished_run, tmp_path, capsys):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "config.json").write_text('{"my": "own config"}')
  (out / "notes.txt").write_text("keep me")
  assert export_hf.main([finished_run, "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"noloco_jax.export_hf: error: --out={str(out)!r} is not empty and is not an export of "
                        "noloco_jax (it holds config.json, notes.txt): nothing was written") and "\n" not in err
  assert sorted(os.listdir(out)) == ["config.json", "notes.txt"] and (out / "config.json").read_text() == '{"my": "own config"}'
  assert export_hf.main([finished_run, "--out", str(out), "--force"]) == 0
  assert (out / "notes.txt").read_text() == "keep me"  # only an export's own file names are replaced
  assert "noloco_jax" in json.loads((out / "config.json").read_text())


def test_a_previous_export_is_replaced_whole(finished_run, tmp_path, capsys):
  out = tmp_path / "hf"
  assert export_hf.main([finished_run, "--out", str(out), "--consensus"]) == 0
  (out / "tokenizer.model").write_bytes(b"a stale file of an earlier export")
  assert export_hf.main([finished_run, "--out", str(out), "--replica", "2"]) == 0
  assert "(replacing the previous export there)" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  assert json.loads((out / "config.json").read_text())["noloco_jax"]["weights"] == "replica 2"
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".export_hf-")]  # no temporary folder left


def test_the_provenance_names_no_path_of_this_machine(exported):
  """Issue 34 item 7: config.json carried the run's absolute workdir."""
  workdir, out, _ = exported
  with open(os.path.join(out, "config.json")) as f:
    text = f.read()
  assert workdir not in text and os.path.dirname(workdir) not in text

  def strings(value):
    if isinstance(value, dict):
      return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
      return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []

  assert not [s for s in strings(json.loads(text)) if s.startswith(("/", "~"))]
  origin = json.loads(text)["noloco_jax"]
  assert (origin["step"], origin["weights"], origin["source"], origin["outer_kind"]) == (12, "consensus", "slow", "noloco")
  assert origin["config"]["model"]["rope_theta"] == 500.0 and "commit" in origin["code"]
  assert export_hf.without_paths({"a": "/data/c4_spm.model", "b": "meta-llama/Meta-Llama-3-8B",
                                  "c": "/x/train/*.txt,~/y/*.txt", "d": ""}) == {
      "a": "c4_spm.model", "b": "meta-llama/Meta-Llama-3-8B", "c": "*.txt,*.txt", "d": ""}
