"""Whether a readable checkpoint fits this run: the same setup, or another replica count by request.

A checkpoint saved with another replica count, model, optimizer, outer method or pairing schedule is
an `IncompatibleCheckpointError` naming the config fields that differ (never a reason to fall back to
an older step); another replica count is resumed only by request (`config.checkpoint.elastic`:
`elastic_plan`, resize.py). A pairing record that contradicts the config saved beside it is a damaged
step (checksum.ItemChecksumError), set aside like any unreadable one.
"""

from __future__ import annotations

from absl import logging
import jax

from noloco_jax.runtime import failures
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import records
from noloco_jax.io.checkpoint import resize
from noloco_jax.io.checkpoint.run_info import RunInfo


class IncompatibleCheckpointError(failures.ReportedError, ValueError):
  """The checkpoint is readable but was saved by a different setup: never a reason to fall back."""


def elastic_plan(run: RunInfo, meta: dict, data: dict, step: int, where: str) -> resize.Plan | None:
  """The resize.Plan for resuming this checkpoint, None for a plain resume (config.checkpoint.elastic)."""
  ck = run.checkpoint
  try:
    mode = resize.mode_for(meta, run.num_replicas, ck)
    plan = None if mode is None else resize.make_plan(
        mode=mode, elastic_replicas=ck.elastic_replicas, old_n=int(meta["num_replicas"]),
        new_n=run.num_replicas, held=resize.held_by_process(data), process_count=jax.process_count(),
        seed=run.seed, step=step, rounds_done=int(meta["round"]), schedule=run.schedule)
  except resize.ResizeError as e:
    raise IncompatibleCheckpointError(f"{where}: {str(e).rstrip('.')}.") from None
  if plan is None and ck.elastic:
    logging.info("checkpoint: config.checkpoint.elastic=%s changes nothing in step %d (same replica count, no "
                 "replica to re-create, or already applied): resumed as saved.", ck.elastic, step)
  return plan


def check(run: RunInfo, meta: dict, abstract, where: str, plan: resize.Plan | None = None) -> None:
  """Raises IncompatibleCheckpointError unless the checkpoint `meta` (at `where`) fits this run (`run`:
  its config record, method and schedule) and its `abstract` state (with `plan`: the rest of the setup
  must match); warns of a changed config field that the resume tolerates."""
  changed = records.config_changes(meta.get("config", {}), run.config_record)
  fields = f"config fields that differ: {_listed(changed)}" if changed else "no config field differs"
  remedy = ("Resume with the checkpoint's values (WORKDIR/config.json), use a new workdir, or start from its "
            "weights with config.checkpoint.warm_start.")
  saved_method = records.saved_method(meta)
  if saved_method != run.method.kind:  # another method's state means something else, even where its shapes agree
    raise IncompatibleCheckpointError(f"{where} was saved by another outer method ({saved_method!r}, now "
                                      f"{run.method.kind!r}); {fields}. {remedy}")
  saved, now = meta["state_shapes"], records.shapes(abstract)
  if plan is not None and plan.old_n != plan.new_n:  # another replica count, by request: the rest must match
    changed = [c for c in changed if not c.startswith("num_replicas:")]
    fields = f"config fields that differ: {_listed(changed)}" if changed else "no other config field differs"
    why = resize.other_differences(saved, now, meta["pairing"], records.schedule_record(run.schedule, meta["round"]))
    if why:
      raise IncompatibleCheckpointError(f"{where} {why}; {fields}. {remedy}")
    if changed:
      logging.warning("resume: the config differs from the checkpoint's in %s.", changed)
    return
  if saved != now:
    diff = [f"{k}: saved {saved.get(k)}, now {now.get(k)}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    raise IncompatibleCheckpointError(
        f"{where} holds a state of another shape (num_replicas, model, optimizer or outer method "
        f"changed); {fields}; state leaves: {diff[:3]}{' ...' if len(diff) > 3 else ''}. {remedy}")
  expected = records.schedule_record(run.schedule, meta["round"])
  if meta["pairing"] != expected:
    # Another schedule only if the config says so; else the record is damaged (not a reason to refuse).
    differs = records.schedule_differences(meta["pairing"], expected)
    if not changed or records.same_schedule_parameters(meta["pairing"], expected):
      # The record contradicts the config saved beside it: with no config field changed, this config's
      # schedule is the one the checkpoint was saved under; and the same schedule (seed, mode, group
      # size, replicas: the schedule's own record) cannot give another grouping. A damaged record,
      # not another setup: set aside like any unreadable step.
      raise checksum.ItemChecksumError(
          f"meta/metadata: its pairing record disagrees with the schedule of its own config "
          f"({differs}): the record is damaged")
    raise IncompatibleCheckpointError(
        f"{where} was saved under another pairing schedule ({differs}); {fields}. Resume with the "
        "checkpoint's config (WORKDIR/config.json), or use a new workdir.")
  if changed:
    logging.warning("resume: the config differs from the checkpoint's in %s; the resumed run is exact "
                    "only for changes of layout (num_devices) or checkpointing.", changed)


def _listed(changes: list[str], shown: int = 6) -> str:
  return "; ".join(changes[:shown]) + (f"; and {len(changes) - shown} more" if len(changes) > shown else "")
