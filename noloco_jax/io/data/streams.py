"""One replica's endless, resumable stream of packed sequences, in two flavours.

Both are pure functions of (seed, replica, num_replicas, data): a process holding any subset of the
replicas produces exactly the rows a single process holding all of them would. Both are Grain
datasets, so Grain's iterators serve them with its get_state/set_state; the state is a few
integers, a checkpoint stores it as JSON and a restored stream continues identically.

- `ArraySequences` (mode "array", a Grain MapDataset): the split is one token array cut into
  sequences of L+1; sequence j belongs to replica j mod R (dealt round-robin: disjoint, balanced
  within one sequence); each replica visits its own sequences in a fresh permutation every epoch,
  seeded by (seed, replica, epoch). Random access: the state is Grain's next index.
- `DocStream` (mode "stream"): for corpora too large to tokenize up front. Units (files or record
  ranges) are dealt to replicas (shard_by "file": unit u to replica u mod R) or every replica reads
  every unit and keeps documents d with (u + d) mod R == r (shard_by "document"). Each epoch the
  replica's units come in a fresh seeded order; documents are packed as they arrive, and blocks of
  `shuffle_buffer` consecutive sequences are emitted in a permutation seeded by where the block
  starts. State = the block's start position + how many of its sequences were served.
  `PackedSequences` serves its batches as a Grain IterDataset (sequential: packing needs the
  previous documents), built where it is iterated, so a Grain worker process can build its own.
"""

import collections
import functools

import grain
import numpy as np

from noloco_jax.io.data import packing

# Distinct stream tags so that e.g. the eval sample never equals a train permutation.
_TAG_TRAIN_SEQUENCES, _TAG_EVAL_SEQUENCES, _TAG_UNIT_ORDER, _TAG_BLOCK = 1, 2, 3, 4


def seeded_rng(*keys: int) -> np.random.Generator:
  """A generator determined by integer keys (negative seeds are mapped into range, not rejected)."""
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) % (1 << 64) for k in keys])))


class ArraySequences(grain.MapDataset):
  """Replica `replica`'s endless sequence of rows [L+1] from a (memory-mapped) token array.

  Element i is the replica's i-th sequence counting over all epochs: epoch i // count, position
  i % count in that epoch's permutation. A pure function of i, so Grain may read elements in any
  order, on any thread or worker process, and a position is just the next index.
  """

  def __init__(self, tokens: np.ndarray, seq_len1: int, seed: int, replica: int, num_replicas: int):
    super().__init__()
    self._tokens, self._l1 = tokens, seq_len1
    self._seed, self._r, self._n_rep = seed, replica, num_replicas
    total = len(tokens) // seq_len1
    if total < num_replicas:  # Checked for the whole job, so every process fails alike.
      raise ValueError(f"the training split has {len(tokens)} tokens = {total} sequences of "
                       f"seq_len+1 = {seq_len1}, fewer than num_replicas = {num_replicas}: some "
                       "replicas would get none. Use more data or a shorter config.data.seq_len.")
    self._count = len(range(replica, total, num_replicas))  # Sequences r, r+R, r+2R, ...
    self._perms = {}  # epoch -> permutation; at most two are alive (see _permutation).

  def __getstate__(self):
    # A Grain worker process gets this dataset pickled: send the memory map's file, not its bytes.
    state = dict(self.__dict__)
    state.pop("_flat", None)
    if isinstance(self._tokens, np.memmap):
      state["_tokens"] = (self._tokens.filename, self._tokens.dtype.str)
    return state

  def __setstate__(self, state):
    if isinstance(state["_tokens"], tuple):
      filename, dtype = state["_tokens"]
      state["_tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r")
    self.__dict__.update(state)

  def __len__(self) -> int:
    # Endless (the next epoch follows seamlessly), below sys.maxsize so that Grain's length
    # arithmetic for batches (a float ceil) still fits an index.
    return 1 << 60

  def _permutation(self, epoch: int) -> np.ndarray:
    perm = self._perms.get(epoch)
    if perm is None:
      perm = seeded_rng(self._seed, _TAG_TRAIN_SEQUENCES, self._r, epoch).permutation(self._count)
      # Reader threads may straddle an epoch boundary; older epochs are never read again.
      self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
      self._perms[epoch] = perm
    return perm

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, j = divmod(int(index), self._count)
    start = (self._r + self._n_rep * int(self._permutation(epoch)[j])) * self._l1
    return self._flat[start:start + self._l1].astype(np.int32)

  @functools.cached_property
  def _flat(self) -> np.ndarray:
    # A plain ndarray view of the same mapped pages: slicing an np.memmap costs ~3x more per row.
    return np.asarray(self._tokens)


class _TokenReader:
  """Reads replica r's documents as one token stream from a position [epoch, k, doc, offset]:
  unit number k of the epoch's order, document index in that unit, token offset in that document.

  Documents are tokenized `packing.DOCS_PER_BATCH` at a time (one parallel tokenizer call); each
  keeps its own index, so the position is exact whatever the batching.
  """

  def __init__(self, stream: "DocStream", position: list[int]):
    self._s = stream
    self.epoch, self.k, self.doc, self.offset = (int(x) for x in position)
    self._docs = None  # Iterator over the current unit's documents.
    self._unit = -1
    self._pending = collections.deque()  # (doc index, tokens) read ahead in the current unit.
    self._cur = None  # Tokens (+ separator) of document `doc`, once read.
    self._docs_since_epoch_start = 0 if self.k == self.doc == self.offset == 0 else None

  def position(self) -> list[int]:
    return [self.epoch, self.k, self.doc, self.offset]

  def take(self, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int32)
    filled = 0
    while filled < n:
      if self._cur is None or self.offset >= len(self._cur):
        self._next_document()
        continue
      m = min(n - filled, len(self._cur) - self.offset)
      out[filled:filled + m] = self._cur[self.offset:self.offset + m]
      filled += m
      self.offset += m
    return out

  def _read_ahead(self) -> None:
    """Tokenizes the next batch of this replica's documents of the current unit into `_pending`."""
    s, batch = self._s, []
    for i, doc in self._docs:
      if doc is not None and s.owns(self._unit, i):
        batch.append((i, doc))
        if len(batch) == packing.DOCS_PER_BATCH:
          break
    wheres = [f"{s.source.unit_name(self._unit)} doc {i}" for i, _ in batch]
    tokens = packing.documents_tokens([d for _, d in batch], s.tok, s.vocab_size, wheres)
    self._pending.extend(zip([i for i, _ in batch], tokens))

  def _next_document(self) -> None:
    s = self._s
    resuming = self._cur is None  # The first document after (re)construction keeps its offset.
    while not self._pending:
      if self._docs is None:
        self._unit = int(s.unit_order(self.epoch)[self.k])
        self._docs = s.source.read(self._unit, self.doc if resuming else 0)
      self._read_ahead()
      if self._pending:
        break
      # The unit is exhausted: on to the next one, and at the end of the order, the next epoch.
      resuming = False
      self._docs, self.doc, self.offset = None, 0, 0
      self.k += 1
      if self.k == len(s.unit_order(self.epoch)):
        if self._docs_since_epoch_start == 0:
          raise ValueError(f"{s.source.name}: replica {s.replica} of {s.num_replicas} found no "
                           f"document in a whole epoch (shard_by={s.shard_by!r}); the data is empty "
                           "or too small to share between this many replicas.")
        self.epoch, self.k, self._docs_since_epoch_start = self.epoch + 1, 0, 0
    i, tokens = self._pending.popleft()
    self.offset = self.offset if resuming and i == self.doc else 0
    self.doc, self._cur = i, tokens
    if self._docs_since_epoch_start is not None:
      self._docs_since_epoch_start += 1


def resolve_shard_by(shard_by: str, num_units: int, num_replicas: int) -> str:
  """"auto" made concrete: whole files when there are enough to go round (each file is then read
  by one replica only), else documents."""
  if shard_by != "auto":
    return shard_by
  return "file" if num_units >= num_replicas else "document"


class DocStream:
  """Replica `replica`'s packed sequences from a streamed source (see module docstring)."""

  def __init__(self, source, tok, vocab_size: int, seq_len1: int, seed: int, replica: int,
               num_replicas: int, shard_by: str, shuffle_buffer: int):
    self.source, self.tok, self.vocab_size = source, tok, vocab_size
    self.seed, self.replica, self.num_replicas = seed, replica, num_replicas
    self._l1, self._k = seq_len1, shuffle_buffer
    self.shard_by = shard_by = resolve_shard_by(shard_by, source.num_units, num_replicas)
    n = source.num_units
    if shard_by == "file":
      self._units = np.arange(replica, n, num_replicas)
      if self._units.size == 0:
        raise ValueError(f"{source.name} has {n} unit(s) (files or record ranges), fewer than "
                         f"num_replicas = {num_replicas}, so replica {replica} gets none with "
                         "config.data.shard_by='file'; use 'document' or 'auto'.")
    else:
      self._units = np.arange(n)
    self._order_epoch, self._order = -1, None
    self.set_state({"position": [0, 0, 0, 0], "served": 0, "filled": False})

  @property
  def epoch(self) -> int:
    """The epoch the next unread token belongs to."""
    return self._reader.epoch

  def owns(self, unit: int, doc: int) -> bool:
    return self.shard_by == "file" or (unit + doc) % self.num_replicas == self.replica

  def unit_order(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      rng = seeded_rng(self.seed, _TAG_UNIT_ORDER, self.replica, epoch)
      self._order, self._order_epoch = rng.permutation(self._units), epoch
    return self._order

  def _fill(self) -> None:
    self._start = self._reader.position()
    block = self._reader.take(self._k * self._l1).reshape(self._k, self._l1)
    perm = seeded_rng(self.seed, _TAG_BLOCK, self.replica, *self._start).permutation(self._k)
    self._block, self._served = block[perm], 0

  def next_batch(self, batch_size: int) -> np.ndarray:
    out = np.empty((batch_size, self._l1), dtype=np.int32)
    for b in range(batch_size):
      if self._block is None or self._served == self._k:
        self._fill()
      out[b] = self._block[self._served]
      self._served += 1
    return out

  def get_state(self) -> dict:
    if self._block is None:
      return {"position": self._reader.position(), "served": 0, "filled": False}
    return {"position": list(self._start), "served": self._served, "filled": True}

  def set_state(self, state: dict) -> None:
    position, served = [int(x) for x in state["position"]], int(state["served"])
    if len(position) != 4 or min(position) < 0 or not 0 <= served <= self._k:
      raise ValueError(f"data iterator state {state} is not a valid stream position "
                       f"(shuffle_buffer {self._k}).")
    if position[1] >= len(self.unit_order(position[0])):
      raise ValueError(f"data iterator state {state}: unit {position[1]} out of range for "
                       f"{self.source.name} (replica {self.replica} has {len(self._units)} units).")
    self._reader = _TokenReader(self, position)
    self._block, self._served = None, 0
    if state.get("filled"):
      self._fill()  # Re-reads the block from its start; the permutation depends only on that start.
      self._served = served


class PackedSequences(grain.IterDataset):
  """A `DocStream` as a Grain IterDataset of batches [B, L+1]; `make_stream()` builds the stream.

  Batches, not rows: the stream packs rows anyway, and handing Grain whole batches saves its
  per-element overhead (4x on the byte-tokenised corpus). `make_stream` is called in `__iter__`,
  i.e. in whichever process iterates (a Grain worker when the pipeline runs there), so only a
  small picklable factory crosses the process boundary.
  """

  def __init__(self, make_stream, batch_size: int):
    super().__init__()
    self._make_stream, self._batch_size = make_stream, batch_size

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedSequencesIterator(self._make_stream(), self._batch_size)


class _PackedSequencesIterator(grain.DatasetIterator):

  def __init__(self, stream: DocStream, batch_size: int):
    super().__init__()
    self._stream, self._batch_size = stream, batch_size

  def __next__(self) -> np.ndarray:
    return self._stream.next_batch(self._batch_size)

  def get_state(self) -> dict:
    return self._stream.get_state()

  def set_state(self, state: dict) -> None:
    self._stream.set_state(state)
