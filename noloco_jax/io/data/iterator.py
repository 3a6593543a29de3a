"""What the trainer calls: the per-process training iterator and the fixed validation batches.

`make_train_iterator` returns batches [len(replica_ids), B, L+1] for the replicas this process holds;
each replica's rows come from its own Grain pipeline (see streams.py), so any subset of replicas
reproduces the rows of the full set. Per replica: the Grain dataset of its batches (rows batched by
Grain in array mode, packed batches in stream mode), optionally read in Grain worker processes
(`config.data.workers`). The replicas' batches are stacked, and Grain's prefetch thread keeps
`prefetch` stacked batches ready. `get_state` holds the Grain iterators' own states after the last
batch the caller *received*, not after what was prefetched.
"""

import functools
from collections.abc import Sequence

from absl import flags
from absl import logging
import grain
import numpy as np

from noloco_jax.io.data import packing
from noloco_jax.io.data import sources
from noloco_jax.io.data import spec as spec_lib
from noloco_jax.io.data import streams

STATE_FORMAT = "noloco_jax.io.data/2"  # 2: Grain iterator states (1 was the hand-written streams').


def _mode(spec: spec_lib.DataSpec, source: sources.Source) -> str:
  return spec.mode or source.default_mode


class _ReplicaBatches:
  """One Grain iterator per held replica; next() stacks their batches. Not thread-safe: Grain's
  prefetch thread is its only caller once prefetching has started."""

  def __init__(self, replica_ids: list[int], datasets: list[grain.IterDataset]):
    self._ids = replica_ids
    # Without workers, iter() builds each replica's stream here, in the caller's thread: bad data
    # is reported by make_train_iterator, not by the first batch.
    self._iters = [iter(d) for d in datasets]

  def __next__(self) -> np.ndarray:
    return np.stack([next(it) for it in self._iters])

  def get_state(self) -> dict:
    return {str(r): it.get_state() for r, it in zip(self._ids, self._iters)}

  def set_state(self, state: dict) -> None:
    for r, it in zip(self._ids, self._iters):
      it.set_state(state[str(r)])

  def close(self) -> None:
    for it in self._iters:
      it.close()


class TrainIterator:
  """Iterator of training batches with exact save/restore; use as a context manager or `close()`."""

  def __init__(self, replica_batches: _ReplicaBatches, replica_ids: Sequence[int], prefetch: int,
               fingerprint: dict):
    self._batches = replica_batches
    self._ids = [int(r) for r in replica_ids]
    self._fingerprint = fingerprint
    # Grain's prefetch thread records the state that goes with each batch it queues, and reports
    # the one of the batch last handed out: what the hand-written thread did before.
    self._it = (grain.experimental.ThreadPrefetchDatasetIterator(replica_batches, prefetch)
                if prefetch > 0 else replica_batches)
    self._error = None
    self._closed = False

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    if self._error is not None:
      raise self._error
    if self._closed:
      raise RuntimeError("the data iterator is closed.")
    try:
      return next(self._it)
    except Exception as e:
      # Raised in Grain's prefetch thread or a worker, re-raised here. The pipeline has stopped
      # mid-batch, so every later call raises the same error rather than continue from nowhere.
      self._error = e
      raise

  def get_state(self) -> dict:
    """JSON-serialisable position of every held replica's stream after the last batch returned."""
    if self._closed:
      raise RuntimeError("the data iterator is closed.")
    return {"format": STATE_FORMAT, "config": dict(self._fingerprint),
            "replicas": dict(self._it.get_state())}

  def set_state(self, state: dict) -> None:
    """Continues exactly where `state` was taken. It may hold more replicas than this process
    (a checkpoint of the whole job); those are ignored, but every held replica must be there."""
    if self._closed:
      raise RuntimeError("the data iterator is closed.")
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
      raise ValueError(f"not a data iterator state of format {STATE_FORMAT!r}: {str(state)[:200]}")
    saved = state.get("config", {})
    diff = {k: (saved.get(k), v) for k, v in self._fingerprint.items() if saved.get(k) != v}
    if diff:
      raise ValueError("the data iterator state was saved under a different data setup; "
                       f"field: (saved, now) = {diff}.")
    missing = [r for r in self._ids if str(r) not in state["replicas"]]
    if missing:
      raise ValueError(f"the data iterator state has no position for replica(s) {missing}.")
    try:
      self._it.set_state({str(r): state["replicas"][str(r)] for r in self._ids})
    except Exception as e:
      # Some replicas may have moved already: refuse to go on with a half-restored iterator.
      self._error = RuntimeError(f"set_state failed ({e}); create a new data iterator.")
      raise
    self._error = None

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      if self._it is not self._batches:
        self._it.close()  # Stops the prefetch thread before the replicas' iterators close.
      self._batches.close()
      # Dropped now, while Grain's modules are alive: their __del__ at interpreter exit would fail.
      self._it = self._batches = None

  def __del__(self):
    if not getattr(self, "_closed", True):
      self.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _doc_stream(spec: spec_lib.DataSpec, vocab_size: int, seed: int, replica: int,
                num_replicas: int) -> streams.DocStream:
  """A replica's DocStream, built from the spec alone: what a Grain worker process runs."""
  source = sources.make_source(spec, "train")
  tok = spec_lib.validate_with_tokenizer(spec, vocab_size=vocab_size)[1]
  return streams.DocStream(source, tok, vocab_size, spec.seq_len + 1, seed, replica, num_replicas,
                           spec.shard_by, spec.shuffle_buffer)


def _in_workers(ds: grain.IterDataset, spec: spec_lib.DataSpec) -> grain.IterDataset:
  """`ds` read by `spec.workers` Grain worker processes (none for 0).

  Why per replica: a replica's rows are one sequence whose order must not depend on how it is
  read. Grain's workers each take every W-th element and Grain interleaves them back in order, so
  a random-access replica (array mode) reads identically with any W; a packed stream is read by one
  worker (W = 1, validated in spec.py), which moves its tokenisation off the training process.
  """
  if spec.workers == 0:
    return ds
  if not flags.FLAGS.is_parsed():
    # Grain reads its absl flags when it starts workers. Outside an absl app (tests, notebooks)
    # nobody parsed them: take the defaults rather than fail.
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec.workers,
                                                     per_worker_buffer_size=max(spec.prefetch, 1)))


def make_train_iterator(config_data, *, seed: int, replica_ids: Sequence[int], num_replicas: int,
                        vocab_size: int) -> TrainIterator:
  """Batches [len(replica_ids), B, L+1] int32; row k belongs to global replica replica_ids[k]."""
  spec, tok = spec_lib.validate_with_tokenizer(config_data, vocab_size=vocab_size)
  replica_ids = [int(r) for r in replica_ids]
  if num_replicas < 1 or not replica_ids or any(not 0 <= r < num_replicas for r in replica_ids) or (
      len(set(replica_ids)) != len(replica_ids)):
    raise ValueError(f"replica_ids={replica_ids} must be distinct ids in [0, num_replicas={num_replicas}).")
  source = sources.make_source(spec, "train")
  mode, l1 = _mode(spec, source), spec.seq_len + 1
  spec_lib.validate_workers(spec, mode)
  fingerprint = {"source": source.name, "mode": mode, "seq_len": spec.seq_len, "seed": int(seed),
                 "num_replicas": int(num_replicas), "tokenizer": tok.fingerprint,
                 "batch_size": spec.batch_size, "workers": spec.workers}
  if mode == "array":
    tokens = packing.token_array(source, tok, spec.data_dir, vocab_size)
    # No reader threads inside a replica's pipeline: a row is one slice of a memory map, and the
    # prefetch thread (or the worker) already runs ahead of the training step.
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    datasets = [streams.ArraySequences(tokens, l1, seed, r, num_replicas).batch(spec.batch_size)
                .to_iter_dataset(read) for r in replica_ids]
    logging.info("data: %s, %d tokens = %d sequences of %d, dealt round-robin to %d replicas; this "
                 "process holds replicas %s.", source.name, len(tokens), len(tokens) // l1, l1,
                 num_replicas, replica_ids)
  else:
    fingerprint["shuffle_buffer"] = spec.shuffle_buffer
    shard_by = streams.resolve_shard_by(spec.shard_by, source.num_units, num_replicas)
    fingerprint["shard_by"] = shard_by
    datasets = [streams.PackedSequences(functools.partial(_doc_stream, spec, vocab_size, seed, r,
                                                          num_replicas), spec.batch_size)
                for r in replica_ids]
    logging.info("data: streaming %s (%d units) to %d replicas, shard_by=%s; this process holds "
                 "replicas %s.", source.name, source.num_units, num_replicas, shard_by, replica_ids)
  datasets = [_in_workers(d, spec) for d in datasets]
  return TrainIterator(_ReplicaBatches(replica_ids, datasets), replica_ids, spec.prefetch, fingerprint)


def make_eval_batches(config_data, *, seed: int, vocab_size: int) -> np.ndarray:
  """The validation batches [eval_batches, B, L+1] int32, the same for every replica and process.

  `seed` picks which validation sequences are used; pass the same seed to compare runs on the
  same sample.
  """
  spec, tok = spec_lib.validate_with_tokenizer(config_data, vocab_size=vocab_size)
  l1, need = spec.seq_len + 1, spec.eval_batches * spec.batch_size
  if need == 0:
    return np.zeros((0, spec.batch_size, l1), dtype=np.int32)
  source = sources.make_source(spec, "eval")
  if _mode(spec, source) == "array":
    tokens = packing.token_array(source, tok, spec.data_dir, vocab_size)
    available = len(tokens) // l1
    if available < need:
      raise _too_small(source, available, spec)
    rng = streams.seeded_rng(seed, streams._TAG_EVAL_SEQUENCES)  # pylint: disable=protected-access
    starts = rng.choice(available, size=need, replace=False) * l1
    flat = np.asarray(tokens[starts[:, None] + np.arange(l1)], dtype=np.int32)
  else:
    # The first `need` sequences of the split, its files in a seeded order, unshuffled inside.
    stream = streams.DocStream(source, tok, vocab_size, l1, seed, 0, 1, "file", 1)
    flat = stream.next_batch(need)
    if stream.epoch > 0:
      raise _too_small(source, f"fewer than {need}", spec)
  return flat.reshape(spec.eval_batches, spec.batch_size, l1)


def _too_small(source, available, spec) -> ValueError:
  return ValueError(
      f"{source.name}: the validation split has {available} sequences of seq_len+1 = {spec.seq_len + 1}"
      f" tokens, but eval_batches * batch_size = {spec.eval_batches * spec.batch_size} are needed; "
      "lower config.data.eval_batches, batch_size or seq_len.")
