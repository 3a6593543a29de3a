"""Checkpoints and exact resume; corrupt-checkpoint fallback; the NaN guard. (SIGTERM: runtime/preemption.py.)

One module per job:

  manager.py     the Checkpointer: one run's orbax manager, shared by its saving and its restoring
  run_info.py    what it is given of the run (RunInfo, made by set-up): never the Config or the Setup
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

Where a run starts (its own latest readable checkpoint, else `checkpoint.warm_start`, else scratch), what
makes a step unreadable and what a failed save does: docs/running.md; elastic resume: docs/elastic.md.
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
from noloco_jax.io.checkpoint.run_info import RunInfo
