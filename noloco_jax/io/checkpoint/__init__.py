"""Checkpoints and exact resume; corrupt-checkpoint fallback; the NaN guard. (SIGTERM: runtime/preemption.py.)

One module per job:

  manager.py     the Checkpointer: one run's orbax manager, shared by its saving and its restoring
  saving.py      a step's three items, the NaN checks before, a failed or unfinished write after
  restoring.py   the latest readable step (verified, else set aside), else a warm start, else fresh
  compatibility.py  whether a readable checkpoint fits this run (or another replica count, by request)
  records.py     what the meta item holds (loop state, pairing, shapes, config) and its JSON forms
  data_item.py   the per-process data item (stream positions of each process's replicas)
  logs.py        metrics.jsonl / pairings.jsonl / elastic.jsonl: durable rows, each once after a resume
  log_repair.py  on resume: rows missing before the restored step, named, and rebuilt where known
  checksum.py    checksums of what a resume reads (each replica's state; digests of the JSON items)
  quarantine.py  unreadable steps moved to workdir/checkpoints_corrupt/
  guard.py       no NaN is saved; nan_policy "error" and "skip_round" (RoundGuard)
  resize.py      elastic resume: another replica set (checkpoint.elastic drop | recreate | grow)

Where a run starts, first match wins:

1. its own workdir: the latest readable checkpoint in `workdir/checkpoints` (exact resume: state,
   data positions, and the loop state: step, round, comm bytes, metric history, pending metrics);
2. `config.checkpoint.warm_start`: a path to another run's workdir, its `checkpoints` directory or
   one step directory. Only the fast weights θ of every replica are taken (the replica count and
   model must match); φ = θ, δ = 0, a fresh inner optimizer, step 0 and the data from the start:
   a new run that begins from trained weights;
3. scratch: the initial weights of `config.seed`.

Orbax writes a step into a temporary directory and renames it only when every item is complete;
steps beyond `config.checkpoint.keep` are deleted only after a newer step is complete. An unreadable
step is quarantined and the previous one taken; when no step is readable the run stops with an
error rather than silently training from scratch; a step whose state does not match its stored
checksums, whose metadata or data positions do not match their digests, or whose pairing record
contradicts its own config counts as unreadable. A checkpoint saved with another replica count, model, optimizer,
outer method (`outer.kind`) or pairing schedule is an error naming the config fields that differ,
not a fallback; another replica count is resumed only by request (`config.checkpoint.elastic`,
resize.py, docs/elastic.md). Another device count or process count is fine: arrays are resharded on restore.
A failed save (disk full) is one error naming the step, the cause and the intact previous step; a
save in flight when the loop raises is completed first (`Saver.settle_after_error`); a SIGINT
during a save is raised once the save is usable (runtime/preemption.py).
"""

from noloco_jax.io.checkpoint.guard import NonFiniteLossError
from noloco_jax.io.checkpoint.guard import NonFiniteStateError
from noloco_jax.io.checkpoint.guard import RoundGuard
from noloco_jax.io.checkpoint.guard import TooManySkippedRoundsError
from noloco_jax.io.checkpoint.guard import check_finite
from noloco_jax.io.checkpoint.guard import nonfinite_replicas
from noloco_jax.io.checkpoint.logs import LOG_FILES
from noloco_jax.io.checkpoint.logs import JsonlLog
from noloco_jax.io.checkpoint.compatibility import IncompatibleCheckpointError
from noloco_jax.io.checkpoint.manager import Checkpointer
from noloco_jax.io.checkpoint.restoring import CHECKPOINT_DIR
from noloco_jax.io.checkpoint.restoring import NoReadableCheckpointError
from noloco_jax.io.checkpoint.saving import CheckpointSaveError
from noloco_jax.io.checkpoint.quarantine import CORRUPT_DIR
from noloco_jax.io.checkpoint.records import FORMAT
from noloco_jax.io.checkpoint.records import pending_from_host
from noloco_jax.io.checkpoint.records import pending_losses
from noloco_jax.io.checkpoint.records import pending_to_host
