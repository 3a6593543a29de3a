"""What the trainer calls: the per-process training iterator and the fixed validation batches.

`make_train_iterator` returns batches [len(replica_ids), B, L+1] for the replicas this process holds;
each replica's rows come from its own stream (see streams.py), so any subset of replicas reproduces
the rows of the full set. A background thread keeps `prefetch` batches ready; `get_state` reports
the position after the last batch the caller *received*, not after what the thread has prefetched.
"""

import copy
import queue
import threading
from collections.abc import Sequence

from absl import logging
import numpy as np

from noloco_jax.io.data import packing
from noloco_jax.io.data import sources
from noloco_jax.io.data import spec as spec_lib
from noloco_jax.io.data import streams

STATE_FORMAT = "noloco_jax.io.data/1"


def _mode(spec: spec_lib.DataSpec, source: sources.Source) -> str:
  return spec.mode or source.default_mode


class TrainIterator:
  """Iterator of training batches with exact save/restore; use as a context manager or `close()`."""

  def __init__(self, replica_streams: list, replica_ids: Sequence[int], batch_size: int,
               prefetch: int, fingerprint: dict):
    self._streams = replica_streams
    self._ids = [int(r) for r in replica_ids]
    self._batch_size, self._prefetch = batch_size, prefetch
    self._fingerprint = fingerprint
    self._state = self._snapshot()
    self._thread = None
    self._error = None
    self._start()

  # ---- production (the background thread, or the caller when prefetch = 0) ----

  def _snapshot(self) -> dict:
    return _snapshot(self._ids, self._streams)

  def _start(self) -> None:
    self._stop = threading.Event()
    if self._prefetch > 0:
      self._queue = queue.Queue(maxsize=self._prefetch)
      # The thread gets what it needs, not `self`: an iterator dropped without close() can then
      # still be garbage-collected, and __del__ stops the thread.
      self._thread = threading.Thread(
          target=_run, args=(self._streams, self._ids, self._batch_size, self._queue, self._stop),
          name="noloco-data-prefetch", daemon=True)
      self._thread.start()

  def _halt(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def __del__(self):
    if getattr(self, "_stop", None) is not None:
      self._stop.set()

  # ---- the caller's side ----

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    if self._error is not None:
      raise self._error
    if self._stop.is_set():
      raise RuntimeError("the data iterator is closed.")
    if self._thread is None:
      batch, state = _produce(self._streams, self._ids, self._batch_size)
    else:
      item = self._queue.get()
      if isinstance(item, BaseException):
        self._error = item
        raise item
      batch, state = item
    self._state = state
    return batch

  def get_state(self) -> dict:
    """JSON-serialisable position of every held replica's stream after the last batch returned."""
    return {"format": STATE_FORMAT, "config": dict(self._fingerprint),
            "replicas": copy.deepcopy(self._state)}

  def set_state(self, state: dict) -> None:
    """Continues exactly where `state` was taken. It may hold more replicas than this process
    (a checkpoint of the whole job); those are ignored, but every held replica must be there."""
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
    self._halt()
    try:
      for r, s in zip(self._ids, self._streams):
        s.set_state(state["replicas"][str(r)])
    except Exception as e:
      # Some streams may have moved already: refuse to go on with a half-restored iterator.
      self._error = RuntimeError(f"set_state failed ({e}); create a new data iterator.")
      raise
    self._state, self._error = self._snapshot(), None
    self._start()

  def close(self) -> None:
    self._halt()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _snapshot(ids: list[int], replica_streams: list) -> dict:
  return {str(r): s.get_state() for r, s in zip(ids, replica_streams)}


def _produce(replica_streams: list, ids: list[int], batch_size: int) -> tuple[np.ndarray, dict]:
  """One batch [R_local, B, L+1] and the streams' state right after it."""
  batch = np.stack([s.next_batch(batch_size) for s in replica_streams])
  return batch, _snapshot(ids, replica_streams)


def _run(replica_streams, ids, batch_size, out: queue.Queue, stop: threading.Event) -> None:
  """The prefetch thread: batches (or the exception that stopped it) into `out` until `stop`."""
  try:
    while not stop.is_set():
      _put(out, stop, _produce(replica_streams, ids, batch_size))
  except BaseException as e:  # pylint: disable=broad-except
    _put(out, stop, e)  # Re-raised in the caller's thread by __next__.


def _put(out: queue.Queue, stop: threading.Event, item) -> None:
  # A bounded put that still notices close(): a full queue must not keep the thread alive.
  while not stop.is_set():
    try:
      out.put(item, timeout=0.05)
      return
    except queue.Full:
      pass


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
  fingerprint = {"source": source.name, "mode": mode, "seq_len": spec.seq_len, "seed": int(seed),
                 "num_replicas": int(num_replicas), "tokenizer": tok.fingerprint}
  if mode == "array":
    tokens = packing.token_array(source, tok, spec.data_dir, vocab_size)
    replica_streams = [streams.ArrayStream(tokens, l1, seed, r, num_replicas) for r in replica_ids]
    logging.info("data: %s, %d tokens = %d sequences of %d, dealt round-robin to %d replicas; this "
                 "process holds replicas %s.", source.name, len(tokens), len(tokens) // l1, l1,
                 num_replicas, replica_ids)
  else:
    fingerprint["shuffle_buffer"] = spec.shuffle_buffer
    replica_streams = [
        streams.DocStream(source, tok, vocab_size, l1, seed, r, num_replicas, spec.shard_by,
                          spec.shuffle_buffer) for r in replica_ids]
    fingerprint["shard_by"] = replica_streams[0].shard_by
    logging.info("data: streaming %s (%d units) to %d replicas, shard_by=%s; this process holds "
                 "replicas %s.", source.name, source.num_units, num_replicas,
                 replica_streams[0].shard_by, replica_ids)
  return TrainIterator(replica_streams, replica_ids, spec.batch_size, spec.prefetch, fingerprint)


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
