"""Tests of the data foundation: byte tokenizer, stdlib corpus, packing, sharding, resumption.

Fast by design: the stdlib corpus is built once per session into a temporary data dir, and most
checks run on tiny text files whose exact token streams are known.
"""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.io import data
from noloco_jax.io.data import packing
from noloco_jax.io.data import sources
from noloco_jax.io.data import stdlib_builder
from noloco_jax.io.data import streams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 256


def data_config(**overrides) -> ml_collections.ConfigDict:
  """config.data of configs/default.py with overrides."""
  c = default.get_config().data
  c.update(overrides)
  return c


@pytest.fixture(scope="session")
def stdlib_dir(tmp_path_factory):
  """A data dir with the stdlib corpus built once for the whole session."""
  d = str(tmp_path_factory.mktemp("tfds"))
  stdlib_builder.prepare(d)
  return d


def write_texts(directory, texts: dict[str, bytes | str]) -> str:
  os.makedirs(directory, exist_ok=True)
  for name, content in texts.items():
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(os.path.join(directory, name), mode) as f:
      f.write(content)
  return os.path.join(directory, "*")


def text_config(tmp_path, train: dict, eval_: dict | None = None, **overrides):
  train_glob = write_texts(tmp_path / "train", train)
  eval_glob = write_texts(tmp_path / "eval", eval_ or {"v.txt": "validation text " * 20})
  return data_config(source="text", train_files=train_glob, eval_files=eval_glob,
                     data_dir=str(tmp_path / "cache"), **overrides)


def take(it, n: int) -> list[np.ndarray]:
  return [next(it) for _ in range(n)]


# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_exact_ids():
  tok = data.make_tokenizer(data_config())
  assert (tok.vocab_size, tok.eos_id) == (257, 256)
  np.testing.assert_array_equal(tok.encode("aé\n"), [97, 195, 169, 10])
  assert tok.decode([104, 105, EOS, 33]) == "hi!"  # The separator is not text.
  assert tok.decode(tok.encode("ünïcode ✓")) == "ünïcode ✓"
  with pytest.raises(ValueError, match="ids must lie in"):
    tok.decode([257])


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_corpus_splits_and_metadata(stdlib_dir):
  builder = stdlib_builder.prepare(stdlib_dir)
  info = builder.info
  n_train, n_val = info.splits["train"].num_examples, info.splits["validation"].num_examples
  assert n_train > 500 and 0.01 < n_val / (n_train + n_val) < 0.06
  import platform  # pylint: disable=g-import-not-at-top
  assert builder.builder_config.name.startswith(f"py{platform.python_version()}-")
  assert info.metadata["python_version"] == platform.python_version()
  assert len(info.metadata["file_list_sha256"]) == 64
  paths = stdlib_builder.list_stdlib_files()
  assert not any("site-packages" in p or "dist-packages" in p for p in paths)
  val = builder.as_data_source(split="validation")
  assert all(stdlib_builder.split_of(val[i]["path"].decode()) == "validation" for i in range(len(val)))


def test_stdlib_prepare_is_safe_from_two_processes(tmp_path):
  code = ("import sys; from noloco_jax.io.data import stdlib_builder as s; "
          "b = s.prepare(sys.argv[1]); print(b.info.splits['train'].num_examples)")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
  counts = [o[0].split()[-1] for o in outs]  # TFDS prints progress to stdout before our line.
  assert counts[0] == counts[1] and int(counts[0]) > 500
  assert sum("prepared" in o[0] for o in outs) == 1  # Built once; the other process waited.


def test_default_config_batches(stdlib_dir):
  c = data_config(data_dir=stdlib_dir)
  with data.make_train_iterator(c, seed=0, replica_ids=range(8), num_replicas=8, vocab_size=257) as it:
    batch = next(it)
  assert batch.shape == (8, 4, 129) and batch.dtype == np.int32
  assert batch.min() >= 0 and batch.max() <= EOS
  assert len({b.tobytes() for b in batch.reshape(32, 129)}) == 32  # Replicas read different data.
  evals = data.make_eval_batches(c, seed=0, vocab_size=257)
  assert evals.shape == (4, 4, 129) and evals.dtype == np.int32
  np.testing.assert_array_equal(evals, data.make_eval_batches(c, seed=0, vocab_size=257))


def test_stdlib_stream_mode_matches_shapes(stdlib_dir):
  c = data_config(data_dir=stdlib_dir, mode="stream", shuffle_buffer=8)
  with data.make_train_iterator(c, seed=1, replica_ids=[0, 3], num_replicas=4, vocab_size=257) as it:
    batches = take(it, 3)
  assert all(b.shape == (2, 4, 129) for b in batches)


# ---------------------------------------------------------------- packing


def test_packing_exact_sequences(tmp_path):
  # Stream: a b EOS c d e EOS f EOS -> with L+1 = 3: [a b EOS] [c d e] [EOS f EOS]; nothing left over.
  c = text_config(tmp_path, {"1.txt": "ab", "2.txt": "cde", "3.txt": "f"}, seq_len=2, batch_size=1,
                  prefetch=0)
  source = sources.make_source(data.validate(c), "train")
  tokens = packing.token_array(source, data.make_tokenizer(c), c.data_dir, 257)
  np.testing.assert_array_equal(tokens, [97, 98, EOS, 99, 100, 101, EOS, 102, EOS])
  it = data.make_train_iterator(c, seed=0, replica_ids=[0, 1, 2], num_replicas=3, vocab_size=257)
  rows = next(it)[:, 0]
  np.testing.assert_array_equal(rows, [[97, 98, EOS], [99, 100, 101], [EOS, 102, EOS]])
  np.testing.assert_array_equal(next(it)[:, 0], rows)  # One sequence each: every epoch repeats it.


def test_array_shards_disjoint_cover_and_reshuffle(tmp_path):
  rng = np.random.default_rng(0)  # Random letters: all 8-token windows differ.
  texts = {f"{i:02d}.txt": "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 10 + i)) for i in range(40)}
  c = text_config(tmp_path, texts, seq_len=7, batch_size=1, prefetch=0)
  source = sources.make_source(data.validate(c), "train")
  tokens = np.asarray(packing.token_array(source, data.make_tokenizer(c), c.data_dir, 257), np.int32)
  n_seq = len(tokens) // 8
  all_seqs = {tokens[j * 8:(j + 1) * 8].tobytes(): j for j in range(n_seq)}
  assert len(all_seqs) == n_seq  # The fixture's sequences are all distinct.
  num_replicas = 3
  it = data.make_train_iterator(c, seed=5, replica_ids=range(num_replicas), num_replicas=num_replicas,
                                vocab_size=257)
  per_epoch = -(-n_seq // num_replicas)
  seen = [[] for _ in range(num_replicas)]
  for _ in range(2 * per_epoch):
    for r, row in enumerate(next(it)[:, 0]):
      seen[r].append(all_seqs[row.tobytes()])
  for r in range(num_replicas):
    count = len(range(r, n_seq, num_replicas))
    epoch0, epoch1 = seen[r][:count], seen[r][count:2 * count]
    assert sorted(epoch0) == list(range(r, n_seq, num_replicas))  # Own sequences, each once.
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0  # Reshuffled next epoch.


def test_reproducible_and_seed_dependent(tmp_path):
  c = text_config(tmp_path, {f"{i}.txt": f"text number {i} " * 30 for i in range(10)}, seq_len=15)
  def run(seed):
    with data.make_train_iterator(c, seed=seed, replica_ids=range(4), num_replicas=4, vocab_size=257) as it:
      return np.stack(take(it, 6))
  np.testing.assert_array_equal(run(3), run(3))
  assert not np.array_equal(run(3), run(4))


@pytest.mark.parametrize("mode", ["array", "stream"])
def test_replica_subset_equals_full_run(tmp_path, mode):
  c = text_config(tmp_path, {f"{i}.txt": f"file {i}: " + "abc" * (5 + i) for i in range(24)},
                  seq_len=9, mode=mode, shuffle_buffer=4)
  with data.make_train_iterator(c, seed=2, replica_ids=range(8), num_replicas=8, vocab_size=257) as it:
    full = np.stack(take(it, 5))
  with data.make_train_iterator(c, seed=2, replica_ids=[5, 2], num_replicas=8, vocab_size=257) as it:
    part = np.stack(take(it, 5))
  np.testing.assert_array_equal(part, full[:, [5, 2]])


@pytest.mark.parametrize("mode", ["array", "stream"])
def test_resume_from_saved_state(tmp_path, mode):
  # Small data and many batches, so the run crosses several epochs and stream blocks.
  c = text_config(tmp_path, {f"{i}.txt": f"resumable {i} " * (3 + i) for i in range(9)}, seq_len=11,
                  batch_size=3, mode=mode, shuffle_buffer=5)
  kw = dict(seed=7, replica_ids=[0, 1, 2], num_replicas=3, vocab_size=257)
  with data.make_train_iterator(c, **kw) as it:
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # Must survive a JSON checkpoint.
    expected = np.stack(take(it, 15))
    it.set_state(state)  # Restoring into the same (prefetching) iterator rewinds it.
    np.testing.assert_array_equal(np.stack(take(it, 15)), expected)
  with data.make_train_iterator(c, **kw) as fresh:
    fresh.set_state(state)
    np.testing.assert_array_equal(np.stack(take(fresh, 15)), expected)
  # A process holding a subset restores the same rows from the whole job's state.
  with data.make_train_iterator(c, **{**kw, "replica_ids": [2]}) as part:
    part.set_state(state)
    np.testing.assert_array_equal(np.stack(take(part, 15))[:, 0], expected[:, 2])
  with data.make_train_iterator(c, **{**kw, "seed": 8}) as other:
    with pytest.raises(ValueError, match="different data setup"):
      other.set_state(state)


def test_prefetch_does_not_change_batches_or_state(tmp_path):
  c = text_config(tmp_path, {f"{i}.txt": "p" * (20 + i) for i in range(6)}, seq_len=5)
  out = {}
  for prefetch in (0, 3):
    c.prefetch = prefetch
    with data.make_train_iterator(c, seed=0, replica_ids=range(2), num_replicas=2, vocab_size=257) as it:
      batches = take(it, 4)
      out[prefetch] = (np.stack(batches), it.get_state())
  np.testing.assert_array_equal(out[0][0], out[3][0])
  assert out[0][1] == out[3][1]


def test_same_batches_in_another_process(tmp_path):
  c = text_config(tmp_path, {f"{i}.txt": f"cross process {i} " * 9 for i in range(5)}, seq_len=13)
  with data.make_train_iterator(c, seed=11, replica_ids=range(2), num_replicas=2, vocab_size=257) as it:
    here = np.stack(take(it, 3))
  code = ("import sys, json, ml_collections, numpy as np; from noloco_jax.io import data; "
          "c = ml_collections.ConfigDict(json.loads(sys.argv[1])); "
          "it = data.make_train_iterator(c, seed=11, replica_ids=[0, 1], num_replicas=2, vocab_size=257); "
          "print(json.dumps(np.stack([next(it) for _ in range(3)]).tolist())); it.close()")
  out = subprocess.run([sys.executable, "-c", code, json.dumps(c.to_dict())], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=True)
  np.testing.assert_array_equal(np.array(json.loads(out.stdout)), here)


# ---------------------------------------------------------------- streaming details


def test_stream_shards_documents_disjoint(tmp_path):
  # One distinct letter per document and seq_len+1 = doc length + 1: each sequence is one document.
  letters = "abcdefghijklmnop"
  c = text_config(tmp_path, {f"{i:02d}.txt": ch * 4 for i, ch in enumerate(letters)}, seq_len=4,
                  batch_size=1, mode="stream", shuffle_buffer=1, prefetch=0)
  for shard_by, num_replicas in (("file", 4), ("document", 4), ("auto", 32)):
    c.shard_by = shard_by
    it = data.make_train_iterator(c, seed=0, replica_ids=range(num_replicas),
                                  num_replicas=num_replicas, vocab_size=257)
    epoch = len(letters) // num_replicas if num_replicas <= len(letters) else 1
    got = [set() for _ in range(num_replicas)]
    if num_replicas > len(letters):  # 'auto' with fewer files than replicas deals by document...
      with pytest.raises(ValueError, match="found no document in a whole epoch"):
        next(it)  # ...and replicas beyond the 16 documents have nothing: a clear error.
      continue
    for _ in range(epoch):
      for r, row in enumerate(next(it)[:, 0]):
        assert row[-1] == EOS and len(set(row[:-1].tolist())) == 1
        got[r].add(chr(row[0]))
    assert set().union(*got) == set(letters) and sum(map(len, got)) == len(letters), shard_by


def test_stream_packs_across_documents_in_order(tmp_path):
  docs = {f"{i}.txt": f"<{i}>" + "z" * i for i in range(5)}
  c = text_config(tmp_path, docs, seq_len=3, batch_size=2, mode="stream", shuffle_buffer=1,
                  shard_by="file", prefetch=0)
  it = data.make_train_iterator(c, seed=4, replica_ids=[0], num_replicas=1, vocab_size=257)
  got = np.concatenate([b[0].reshape(-1) for b in take(it, 3)])
  order = streams.seeded_rng(4, 3, 0, 0).permutation(5)  # The replica's unit order in epoch 0.
  files = sorted(docs)  # Units are the files in sorted order.
  expected = np.concatenate([list(docs[files[u]].encode()) + [EOS] for u in order])
  np.testing.assert_array_equal(got, expected[:len(got)])


# ---------------------------------------------------------------- eval


def test_eval_batches_deterministic_and_too_small(tmp_path):
  # 95 distinct characters + separator = 9 distinct sequences of 10.
  c = text_config(tmp_path, {"t.txt": "train " * 50}, {"v.txt": bytes(range(32, 127))}, seq_len=9,
                  batch_size=2, eval_batches=3)
  a = data.make_eval_batches(c, seed=1, vocab_size=257)
  assert a.shape == (3, 2, 10)
  np.testing.assert_array_equal(a, data.make_eval_batches(c, seed=1, vocab_size=257))
  assert len({row.tobytes() for row in a.reshape(6, 10)}) == 6  # Sampled without replacement.
  assert not np.array_equal(a, data.make_eval_batches(c, seed=2, vocab_size=257))
  c.mode = "stream"
  s = data.make_eval_batches(c, seed=1, vocab_size=257)
  assert s.shape == (3, 2, 10)
  c.eval_batches = 20
  for mode in ("array", "stream"):
    c.mode = mode
    with pytest.raises(ValueError, match="validation split has"):
      data.make_eval_batches(c, seed=1, vocab_size=257)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("overrides,kwargs,match", [
    ({"seq_len": 0}, {}, r"seq_len=0 .*≥ 1"),
    ({"batch_size": -2}, {}, r"batch_size=-2 .*≥ 1"),
    ({"eval_batches": -1}, {}, r"eval_batches=-1"),
    ({"source": "wiki"}, {}, r"source='wiki' .*stdlib"),
    ({"tokenizer": "gpt"}, {}, r"tokenizer='gpt' .*bytes"),
    ({"mode": "ram"}, {}, r"mode='ram'"),
    ({"shard_by": "host"}, {}, r"shard_by='host'"),
    ({"seq_len": 2048}, {"model_max_seq_len": 1024}, r"seq_len=2048 .*1024"),
    ({}, {"vocab_size": 200}, r"vocab_size 257.*200"),
    ({"source": "c4_json", "path": "/nonexistent/c4"}, {}, r"path='/nonexistent/c4'"),
    ({"source": "text", "train_files": "/nonexistent/*.txt"}, {}, r"train_files=.*matches no file"),
    ({"source": "tfds"}, {}, r"tfds_name=''"),
    ({"tokenizer": "sentencepiece", "spm_model": "/nope.model"}, {}, r"spm_model='/nope.model'"),
    ({"tokenizer": "pretokenized", "source": "parquet"}, {}, r"train_files"),
])
def test_validate_errors(overrides, kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.validate(data_config(**overrides), **kwargs)


def test_validate_accepts_default_and_rejects_unknown_field():
  data.validate(data_config(), model_max_seq_len=128, vocab_size=257)
  c = data_config()
  c.seq_lenght = 64
  with pytest.raises(ValueError, match="seq_lenght is not a field; did you mean config.data.seq_len"):
    data.validate(c)


def test_replica_ids_checked(tmp_path):
  c = text_config(tmp_path, {"a.txt": "abc" * 40}, seq_len=3)
  for ids, n in (([0, 4], 4), ([1, 1], 4), ([], 2)):
    with pytest.raises(ValueError, match="replica_ids"):
      data.make_train_iterator(c, seed=0, replica_ids=ids, num_replicas=n, vocab_size=257)


def test_too_little_data_for_replicas(tmp_path):
  c = text_config(tmp_path, {"a.txt": "abcdefgh"}, seq_len=3)
  with pytest.raises(ValueError, match="fewer than num_replicas"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=8, vocab_size=257)


def test_dropped_iterator_stops_its_thread(tmp_path):
  import gc  # pylint: disable=g-import-not-at-top
  c = text_config(tmp_path, {"a.txt": "dropped " * 50}, seq_len=7)
  import threading  # pylint: disable=g-import-not-at-top

  def prefetch_threads():
    return {t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch")}

  before = prefetch_threads()
  it = data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)
  next(it)
  started = prefetch_threads() - before
  assert len(started) == 1  # The iterator's own prefetch thread is running ...
  del it
  gc.collect()
  for thread in started:
    thread.join(timeout=10)
    assert not thread.is_alive()  # ... and stops with it.


def test_bad_states_are_rejected(tmp_path):
  c = text_config(tmp_path, {"a.txt": "state " * 50}, seq_len=7)
  with data.make_train_iterator(c, seed=0, replica_ids=[0, 1], num_replicas=2, vocab_size=257) as it:
    state = it.get_state()
    with pytest.raises(ValueError, match="not a data iterator state"):
      it.set_state({"replicas": state["replicas"]})
    del state["replicas"]["1"]
    with pytest.raises(ValueError, match=r"no position for replica\(s\) \[1\]"):
      it.set_state(state)
    np.testing.assert_array_equal(next(it).shape, (2, 4, 8))  # Still usable after a rejected state.
