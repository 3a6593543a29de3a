"""Tests of the real-data sources and tokenizers on fixture files the tests write themselves:
C4 JSON lines, pre-tokenized parquet, text files, tiny TFDS builds (array_record and tfrecord),
a SentencePiece model trained on the fly, and a Hugging Face tokenizer when the package exists."""

import gzip
import json
import logging
import os
import subprocess
import sys

from etils import epath
import numpy as np
import pytest
import tensorflow_datasets as tfds

import ml_collections

from configs import default
from noloco_jax.io import data
from noloco_jax.io.data import sources
from noloco_jax.io.data import spec as spec_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 256


def data_config(**overrides) -> ml_collections.ConfigDict:
  """config.data of configs/default.py with overrides."""
  c = default.get_config().data
  c.update(overrides)
  return c


def write_texts(directory, texts: dict) -> str:
  os.makedirs(directory, exist_ok=True)
  for name, content in texts.items():
    with open(os.path.join(directory, name), "wb" if isinstance(content, bytes) else "w") as f:
      f.write(content)
  return os.path.join(directory, "*")


def take(it, n: int) -> list:
  return [next(it) for _ in range(n)]


def epoch_documents(config, total_tokens: int, vocab_size: int = 257, eos: int = EOS) -> list[list[int]]:
  """The first `total_tokens` of the stream of a single replica, split at separators.

  With shuffle_buffer 1 the stream is the epoch's documents in order, each + separator.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  config.shuffle_buffer = 1
  with data.make_train_iterator(config, seed=0, replica_ids=[0], num_replicas=1, vocab_size=vocab_size) as it:
    flat = []
    while len(flat) < total_tokens:
      flat.extend(next(it)[0].reshape(-1).tolist())
  docs, cur = [], []
  for t in flat[:total_tokens]:
    if t == eos:
      docs.append(cur)
      cur = []
    else:
      cur.append(t)
  assert not cur  # One epoch ends exactly on a separator.
  return docs


# ---------------------------------------------------------------- C4 JSON lines


def write_c4(directory, split: str, files: list[list[bytes]]) -> None:
  os.makedirs(directory, exist_ok=True)
  for i, lines in enumerate(files):
    with gzip.open(os.path.join(directory, f"c4-{split}.{i:05d}-of-{len(files):05d}.json.gz"), "wb") as f:
      f.write(b"\n".join(lines) + b"\n")


def c4_line(text: str) -> bytes:
  return json.dumps({"text": text, "url": "http://x", "timestamp": "2019"}).encode()


def test_c4_json_exact_documents_and_bad_lines(tmp_path, caplog):
  good = [[c4_line(f"doc {f}.{i} é") for i in range(4)] for f in range(3)]
  good[1].append(b'{"text": "caf\xe9 latin-1"}')  # Invalid UTF-8: replaced and counted.
  good[2].append(b"")  # Empty line: skipped and counted.
  good[2].append(c4_line(""))  # Empty text: skipped and counted.
  write_c4(tmp_path, "train", good)
  write_c4(tmp_path, "validation", [[c4_line("validation document " * 10)] * 5])
  c = data_config(source="c4_json", path=str(tmp_path), seq_len=15, batch_size=2, shuffle_buffer=3,
                  data_dir=str(tmp_path / "cache"))
  expected = [f"doc {f}.{i} é" for f in range(3) for i in range(4)] + ["caf\ufffd latin-1"]
  total = sum(len(t.encode()) + 1 for t in expected)
  with caplog.at_level(logging.WARNING):
    docs = epoch_documents(c, total)
  assert sorted(bytes(d).decode() for d in docs) == sorted(expected)
  assert "non_utf8" in caplog.text and "empty" in caplog.text
  source = sources.make_source(data.validate(c), "train")
  list(source.read(1)), list(source.read(2))
  assert source.log.counts == {"non_utf8": 1, "empty": 2}
  assert data.make_eval_batches(c, seed=0, vocab_size=257).shape == (4, 2, 16)


def test_c4_json_errors(tmp_path):
  c = data_config(source="c4_json", path=str(tmp_path), data_dir=str(tmp_path / "cache"))
  with pytest.raises(ValueError, match=r"no c4-train\.\*\.json\.gz"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)
  write_c4(tmp_path, "train", [[json.dumps({"content": "x"}).encode()]])
  it = data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)
  with pytest.raises(ValueError, match=r"no field config.data.text_field='text'.*content"):
    next(it)  # Raised in the prefetch thread, re-raised here.
  it.close()


def test_c4_json_shards_files_between_replicas(tmp_path):
  write_c4(tmp_path, "train", [[c4_line(chr(ord("a") + f) * 7)] * 3 for f in range(4)])
  c = data_config(source="c4_json", path=str(tmp_path), seq_len=7, batch_size=3, shuffle_buffer=1,
                  data_dir=str(tmp_path / "cache"))
  with data.make_train_iterator(c, seed=0, replica_ids=range(4), num_replicas=4, vocab_size=257) as it:
    batch = next(it)
  letters = [{chr(t) for t in batch[r, :, 0]} for r in range(4)]
  assert all(len(s) == 1 for s in letters) and len(set.union(*letters)) == 4  # One file per replica.


# ---------------------------------------------------------------- parquet (pre-tokenized)


def write_parquet(path, ids: list[list[int]], mask: list[list[int]] | None = None, **extra) -> None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  columns = {"input_ids": pa.array(ids, type=pa.list_(pa.int32()))} if ids is not None else {}
  if mask is not None:
    columns["attention_mask"] = pa.array(mask, type=pa.list_(pa.int8()))
  columns.update({k: pa.array(v) for k, v in extra.items()})
  pq.write_table(pa.table(columns), path, row_group_size=2)


def parquet_config(tmp_path, **overrides):
  fields = dict(source="parquet", tokenizer="pretokenized", vocab_size=1000, eos_id=999,
                train_files=str(tmp_path / "train-*.parquet"), eval_files=str(tmp_path / "val-*.parquet"),
                data_dir=str(tmp_path / "cache"))
  return data_config(**{**fields, **overrides})


def test_parquet_mask_padding_and_exact_ids(tmp_path):
  write_parquet(tmp_path / "train-0.parquet", [[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 0, 0, 0, 0]],
                [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
  write_parquet(tmp_path / "train-1.parquet", [[7, 8], [9, 10, 11], [], [12]])  # No mask column.
  write_parquet(tmp_path / "val-0.parquet", [list(range(20, 40))])
  c = parquet_config(tmp_path, seq_len=4, batch_size=1, shuffle_buffer=1)
  docs = epoch_documents(c, 3 + 2 + 1 + 2 + 3 + 1 + 6, vocab_size=1000, eos=999)  # + 6 separators.
  assert sorted(docs) == sorted([[1, 2, 3], [4, 5], [6], [7, 8], [9, 10, 11], [12]])
  evals = data.make_eval_batches(c, seed=0, vocab_size=1000)
  np.testing.assert_array_equal(evals.reshape(-1)[:20], range(20, 40))


def test_parquet_resume_mid_file(tmp_path):
  for f in range(3):
    write_parquet(tmp_path / f"train-{f}.parquet", [[f * 100 + i] * (i + 1) for i in range(9)])
  write_parquet(tmp_path / "val-0.parquet", [list(range(50))])
  c = parquet_config(tmp_path, seq_len=5, batch_size=2, shuffle_buffer=3)
  kw = dict(seed=3, replica_ids=[0, 1], num_replicas=2, vocab_size=1000)
  with data.make_train_iterator(c, **kw) as it:
    take(it, 4)
    state = it.get_state()
    expected = np.stack(take(it, 10))
  with data.make_train_iterator(c, **kw) as it:
    it.set_state(state)
    np.testing.assert_array_equal(np.stack(take(it, 10)), expected)


def test_parquet_errors(tmp_path):
  write_parquet(tmp_path / "train-0.parquet", None, tokens=[[1, 2]])
  write_parquet(tmp_path / "val-0.parquet", [[1, 2, 3]])
  c = parquet_config(tmp_path)
  with pytest.raises(ValueError, match=r"no column config.data.parquet_ids_field='input_ids'.*tokens"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=1000)
  write_parquet(tmp_path / "train-0.parquet", [[1, 2, 1500]])  # Id outside the model's vocabulary.
  with data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=1000) as it:
    with pytest.raises(ValueError, match=r"token id 1500 is outside the model's vocabulary \[0, 1000\)"):
      next(it)
  with pytest.raises(ValueError, match=r"eos_id=5000"):
    data.validate(parquet_config(tmp_path, eos_id=5000))
  with pytest.raises(ValueError, match=r"tokenizer='pretokenized'"):
    data.validate(data_config(tokenizer="pretokenized", vocab_size=10, eos_id=1))


def test_parquet_empty_file_is_counted_skip(tmp_path, caplog):
  write_parquet(tmp_path / "train-0.parquet", [])
  write_parquet(tmp_path / "train-1.parquet", [[5, 6, 7]] * 4)
  write_parquet(tmp_path / "val-0.parquet", [[1] * 30])
  c = parquet_config(tmp_path, seq_len=3, batch_size=1)
  with caplog.at_level(logging.WARNING):
    with data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=1000) as it:
      np.testing.assert_array_equal(np.unique(next(it)), [5, 6, 7, 999])
  assert "empty" in caplog.text and "train-0.parquet" in caplog.text


# ---------------------------------------------------------------- text files


def test_text_non_utf8_and_empty_files_are_counted(tmp_path, caplog):
  glob_ = write_texts(tmp_path / "t", {"a.txt": b"caf\xe9", "b.txt": b"", "c.txt": "ok"})
  c = data_config(source="text", train_files=glob_, eval_files=glob_, data_dir=str(tmp_path / "cache"),
                  seq_len=3, batch_size=1, prefetch=0)
  with caplog.at_level(logging.WARNING):
    source = sources.make_source(data.validate(c), "train")
    docs = [d for u in range(source.num_units) for _, d in source.read(u)]
  assert docs == ["caf\ufffd", None, "ok"]
  assert source.log.counts == {"non_utf8": 1, "empty": 1}
  assert "non_utf8" in caplog.text and "b.txt" in caplog.text
  with data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257) as it:
    assert next(it).shape == (1, 1, 4)


# ---------------------------------------------------------------- TFDS


class NolocoTinyCorpus(tfds.core.GeneratorBasedBuilder):
  """A 36-document corpus for the tfds source tests."""

  VERSION = tfds.core.Version("1.0.0")
  code_path = epath.Path(__file__)  # See stdlib_builder: avoids TFDS's importlib_resources path.

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"text": tfds.features.Text(), "id": np.int32}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(0, 30), "validation": self._generate_examples(30, 36)}

  def _generate_examples(self, lo, hi):
    for i in range(lo, hi):
      yield i, {"text": tiny_doc(i), "id": i}


def tiny_doc(i: int) -> str:
  return f"tiny {i} " * (i % 4 + 1)


@pytest.fixture(scope="module")
def tiny_tfds(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("array_record"))
  NolocoTinyCorpus(data_dir=d, file_format="array_record").download_and_prepare()
  return {"array_record": d, "tfrecord": _as_tfrecord_build(d, str(tmp_path_factory.mktemp("tfrecord")))}


def _as_tfrecord_build(src: str, dst: str) -> str:
  """The array_record build re-framed as a tfrecord build, without TensorFlow (writing tfrecord
  through TFDS needs it): both formats hold the same serialized tf.train.Example records."""
  import shutil  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  from tensorboard.summary.writer import record_writer  # pylint: disable=g-import-not-at-top

  shutil.copytree(src, dst, dirs_exist_ok=True)
  for root, _, files in os.walk(dst):
    for name in files:
      path = os.path.join(root, name)
      if ".array_record-" in name:
        reader = array_record_module.ArrayRecordReader(path)
        records = reader.read_all()
        reader.close()
        with open(path.replace(".array_record-", ".tfrecord-"), "wb") as f:
          writer = record_writer.RecordWriter(f)
          for r in records:
            writer.write(r)
        os.remove(path)
      elif name == "dataset_info.json":
        with open(path) as f:
          info = json.load(f)
        assert info["fileFormat"] == "array_record", info.get("fileFormat")
        info["fileFormat"] = "tfrecord"
        with open(path, "w") as f:
          json.dump(info, f)
  return dst


@pytest.mark.parametrize("fmt", ["array_record", "tfrecord"])
def test_tfds_source_reads_every_document(tiny_tfds, fmt):
  c = data_config(source="tfds", tfds_name="noloco_tiny_corpus", data_dir=tiny_tfds[fmt], seq_len=9,
                  batch_size=2, shuffle_buffer=2)
  expected = [tiny_doc(i) for i in range(30)]
  docs = epoch_documents(c, sum(len(t) + 1 for t in expected))
  assert sorted(bytes(d).decode() for d in docs) == sorted(expected)
  evals = data.make_eval_batches(c, seed=0, vocab_size=257)
  assert evals.shape == (4, 2, 10)


def test_tfds_errors(tiny_tfds, tmp_path):
  c = data_config(source="tfds", tfds_name="noloco_tiny_corpus", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="is not prepared"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)
  c.update(data_dir=tiny_tfds["array_record"], text_field="body")
  with pytest.raises(ValueError, match=r"text_field='body' .*valid: \['id', 'text'\]"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)
  c.update(text_field="text", tfds_name="no_such_dataset_xyz")
  with pytest.raises(ValueError, match="not found"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)


# ---------------------------------------------------------------- SentencePiece


def test_sentencepiece_trained_by_cli(tmp_path):
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghij"), rng.integers(2, 7))) for _ in range(60)]
  lines = [" ".join(rng.choice(words, 12)) for _ in range(300)]
  glob_ = write_texts(tmp_path / "t", {f"{i}.txt": "\n".join(lines[i::5]) for i in range(5)})
  out = str(tmp_path / "spm" / "tiny")
  cmd = [sys.executable, "-m", "noloco_jax.io.data.train_spm", f"--config={REPO}/configs/text.py",
         f"--config.data.train_files={glob_}", f"--config.data.eval_files={glob_}",
         "--vocab_size=300", f"--output={out}"]
  subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
  c = data_config(source="text", train_files=glob_, eval_files=glob_, tokenizer="sentencepiece",
                  spm_model=out + ".model", seq_len=16, data_dir=str(tmp_path / "cache"))
  tok = data.make_tokenizer(c)
  assert (tok.vocab_size, tok.eos_id) == (300, 1)
  assert tok.decode(tok.encode(lines[0] + "\n  ü")) == lines[0] + "\n  ü"  # Lossless, byte fallback.
  data.validate(c, model_max_seq_len=16, vocab_size=300)
  with data.make_train_iterator(c, seed=0, replica_ids=[0, 1], num_replicas=2, vocab_size=300) as it:
    batch = next(it)
  assert batch.shape == (2, 4, 17) and batch.max() < 300
  with pytest.raises(ValueError, match="vocab_size 300, more than the model's vocab_size 257"):
    data.validate(c, vocab_size=257)


# ---------------------------------------------------------------- Hugging Face


def test_hf_tokenizer_local_file(tmp_path, monkeypatch):
  tokenizers = pytest.importorskip("tokenizers", reason="optional extra noloco_jax[hf] not installed")
  vocab = {"[UNK]": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  monkeypatch.delenv("HF_TOKEN", raising=False)
  c = data_config(tokenizer="hf", hf_tokenizer=str(tmp_path))
  hf = data.make_tokenizer(c)
  assert (hf.vocab_size, hf.eos_id) == (4, 1)
  np.testing.assert_array_equal(hf.encode("hello world moon"), [2, 3, 0])


def test_hf_missing_package_is_a_clear_error(monkeypatch):
  for name in ("tokenizers", "transformers"):
    monkeypatch.setitem(sys.modules, name, None)  # Makes `import name` fail.
  with pytest.raises(ImportError, match=r"noloco_jax\[hf\]"):
    data.make_tokenizer(data_config(tokenizer="hf", hf_tokenizer="gpt2"))


def test_hf_wiring_with_a_stand_in_package(tmp_path, monkeypatch):
  """Runs without the optional package: a stand-in `tokenizers` module checks how we call it,
  including that the access token comes from HF_TOKEN in the environment."""
  import types  # pylint: disable=g-import-not-at-top

  calls = {}

  class FakeTokenizer:
    vocab = {"<|end_of_text|>": 5}

    @classmethod
    def from_file(cls, path):
      calls["file"] = path
      return cls()

    @classmethod
    def from_pretrained(cls, name, token=None):
      calls["hub"] = (name, token)
      return cls()

    def get_vocab_size(self, with_added_tokens):
      return 6

    def token_to_id(self, t):
      return self.vocab.get(t)

    def encode(self, s, add_special_tokens):
      assert not add_special_tokens  # Documents get our separator, not the tokenizer's BOS/EOS.
      return types.SimpleNamespace(ids=[len(w) % 5 for w in s.split()])

    def decode(self, ids):
      return " ".join(map(str, ids))

  monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=FakeTokenizer))
  monkeypatch.setenv("HF_TOKEN", "secret-from-env")
  tok = data.make_tokenizer(data_config(tokenizer="hf", hf_tokenizer="org/model"))
  assert calls["hub"] == ("org/model", "secret-from-env")
  assert (tok.vocab_size, tok.eos_id) == (6, 5)
  np.testing.assert_array_equal(tok.encode("a bb ccc"), [1, 2, 3])
  (tmp_path / "tokenizer.json").write_text("{}")
  data.make_tokenizer(data_config(tokenizer="hf", hf_tokenizer=str(tmp_path)))
  assert calls["file"] == str(tmp_path / "tokenizer.json")
  with pytest.raises(ValueError, match="eos_id"):
    data.make_tokenizer(data_config(tokenizer="hf", hf_tokenizer="org/model", eos_id=9))


@pytest.mark.parametrize("name,arg", [("c4", None), ("c4", "tfds,llama3,smoke"), ("reddit", "smoke"),
                                      ("text", None)])
def test_real_data_configs_load(name, arg):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  fields = spec_lib.to_spec(module.get_config(arg).data)  # Every field known and well-typed.
  assert fields.source in {"c4_json", "tfds", "parquet", "text"}
  if arg and "tfds" in arg:
    assert (fields.tfds_name, fields.tokenizer, fields.seq_len) == ("c4/en", "hf", 32)


# ---------------------------------------------------------------- C4's bad input on the command line


@pytest.mark.parametrize("module,args,last_line", [
    ("noloco_jax.main", ["--workdir={tmp}/run", "--config.data.path={tmp}/no_such_dir"],
     "noloco_jax: config.data.path='{tmp}/no_such_dir' is not valid: an existing directory holding "
     "c4-train.*.json.gz files."),
    ("noloco_jax.io.data.train_spm", ["--output={tmp}/spm", "--config.data.path={tmp}/no_such_dir"],
     "noloco_jax: config.data.path='{tmp}/no_such_dir' is not valid: an existing directory holding "
     "c4-train.*.json.gz files."),
    ("noloco_jax.io.data.train_spm", ["--output={tmp}/spm", "--config.data.path={tmp}"],
     "noloco_jax: config.data.path='{tmp}' holds no c4-train.*.json.gz (or .json) file; check the directory "
     "and config.data.train_split / eval_split."),
], ids=["main_no_such_path", "train_spm_no_such_path", "train_spm_no_c4_files"])
def test_c4_bad_input_is_one_line_and_exits_2(tmp_path, module, args, last_line):
  """Issue 34 item 2: the trainer and train_spm on a C4 path that does not exist ended in a traceback
  (exit 1), where every other source gets one line naming the field (exit 2)."""
  tmp = str(tmp_path)
  proc = subprocess.run([sys.executable, "-m", module, f"--config={REPO}/configs/c4.py",
                         *(a.format(tmp=tmp) for a in args)], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == last_line.format(tmp=tmp), proc.stderr[-3000:]
