"""Checksums of everything a resume reads: every replica's state, the meta record, each data file.

Orbax reads back whatever bytes the state's data files hold: an 8-byte overwrite inside one was
restored without complaint and trained on (the run ended at eval/loss 9.2 instead of 2.3). The meta
item therefore carries one checksum per replica of the whole state (every leaf, counters included),
computed from the arrays being saved; restore computes it again from the arrays read and treats a
mismatch like any unreadable step (quarantined, the previous step taken, a warning).

The sums are the start-up check's, by the same jitted function (runtime/distributed.py's
`replica_checksum_fn`: changing any word of a replica's leaf changes them), combined over leaves with
odd weights. They are computed on the
devices, each replica where it lives, layout-independent: a checkpoint restored onto another device
or process count checks out. Cost: one jitted reduction per save, ~20 ms for the default job's 79 MB
state on a 2-core CPU (experiments/RESULTS.md).

The JSON items are covered too: an edited `next_index` in data/process_0.json resumed silently (and
changed the final loss), an edited `comm_bytes` in the meta shifted every later
`comm/bytes_per_replica`. The meta record and every process's data file therefore carry a SHA-256
digest of their own canonical JSON (`digest`), and each data file names the step and process count
of its checkpoint, so a file of another step, a missing or an extra one is caught as well. Restore
checks all of them before it uses any (`verify_items`) and treats a mismatch like an unreadable step.
Checkpoints written before digests were stored (format /1) are read as they are.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from noloco_jax.inner.state import TrainState
from noloco_jax.runtime import distributed


class StateChecksumError(ValueError):
  """The state read back differs from the state that was saved (a data file changed on disk)."""


class ItemChecksumError(ValueError):
  """A JSON item of the checkpoint (meta or data) differs from what was saved, or one is missing."""


DIGEST = "digest"  # the key of a JSON item's own digest


def digest(item: dict[str, Any]) -> str:
  """SHA-256 of the item's canonical JSON, its own `digest` field left out.

  Canonical: sorted keys, no spaces, after a JSON round trip (tuples become lists), so the digest
  computed at save time is the one computed from the file read back.
  """
  body = {k: v for k, v in json.loads(json.dumps(item)).items() if k != DIGEST}
  return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def with_digest(item: dict[str, Any]) -> dict[str, Any]:
  """A snapshot of `item` as its JSON reads back (sharing no object with it), with its digest.

  A snapshot, not `item` itself: orbax writes a JSON item later, on a thread of its own, while the
  training loop goes on adding to the objects it was built from (the history). Written live, a save
  under load held a later history than it digested and failed its own check (issue 33).
  """
  body = json.loads(json.dumps(item))
  return {**body, DIGEST: digest(body)}


def _check_digest(name: str, item: Any, required: bool) -> None:
  if not isinstance(item, dict):
    raise ItemChecksumError(f"{name} is not a JSON object")
  if DIGEST not in item:
    if required:
      raise ItemChecksumError(f"{name} has no digest")
    return
  if item[DIGEST] != digest(item):
    raise ItemChecksumError(f"{name} does not match the digest stored at save time: it was changed after the save")


def verify_items(meta: dict, data_files: dict[str, Any], step: int, digests_required: bool) -> None:
  """Raises ItemChecksumError unless the meta record and the data files are the ones saved for `step`.

  `data_files`: {file name: content} of the step's data item (data_item.py). With `digests_required`
  (format /2 and later) every item must carry its digest.
  """
  _check_digest("meta/metadata", meta, digests_required)
  if not digests_required:
    return
  count = meta.get("process_count")
  expected = {f"process_{i}.json" for i in range(count)} if isinstance(count, int) else set()
  if set(data_files) != expected:
    raise ItemChecksumError(f"data item: files {sorted(data_files)}, but the step was saved by {count} process(es) "
                            f"({sorted(expected)})")
  for name, item in sorted(data_files.items()):
    _check_digest(f"data/{name}", item, required=True)
    if (item.get("step"), item.get("process_count"), f"process_{item.get('process_index')}.json") != (step, count, name):
      raise ItemChecksumError(f"data/{name} belongs to another checkpoint (step {item.get('step')}, process "
                              f"{item.get('process_index')} of {item.get('process_count')})")


def state_checksums(state: TrainState, mesh) -> list[str]:
  """One hex checksum per replica of the whole state."""
  return [row.tobytes().hex() for row in distributed.replica_checksums(mesh, state)]


def verify(meta: dict, state: TrainState, mesh) -> None:
  """Raises StateChecksumError unless `state` matches the checksums saved in `meta` (if any)."""
  saved = meta.get("state_checksums")
  if saved is None:  # written before checksums were stored: nothing to compare
    return
  now = state_checksums(state, mesh)
  bad = [r for r, (a, b) in enumerate(zip(saved, now)) if a != b]
  if bad or len(saved) != len(now):
    raise StateChecksumError(f"the state read back does not match the checksum stored at save time on "
                             f"replica(s) {bad}: a data file was changed after the save")
