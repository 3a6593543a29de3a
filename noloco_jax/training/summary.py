"""The end-of-run summary: the one screen printed when a run ends, and what WORKDIR/summary.json holds."""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from noloco_jax.training.loop_state import LoopState


def summarize(config, loop: LoopState, num_params: int, seconds: float) -> dict[str, Any]:
  """The end-of-run summary: {"text": the printed screen, and the scalars summary.json holds}."""
  evals, comm_bytes = loop.history["eval"], loop.comm_bytes
  first, last = evals[0], evals[-1]
  train = loop.history.get("train", {})
  lines = [
      "=" * 72,
      f"noloco_jax: {config.outer.kind} | {config.num_replicas} replicas | {config.num_steps} steps "
      f"| H={config.outer.inner_steps} | model {config.model.arch} {config.model.preset} "
      f"({num_params:,} params per replica)",
      f"eval/loss   {first['eval/loss']:.4f} (step {first['step']}) -> {last['eval/loss']:.4f} (step {last['step']})",
      f"eval/ppl    {last['eval/ppl']:.3f}",
      f"train/loss  {train.get('train/loss', float('nan')):.4f}",
      f"replicas/weight_std  {last['replicas/weight_std']:.3e}",
      f"comm/bytes_per_replica  {comm_bytes:,} ({comm_bytes / 2**20:.1f} MiB)",
      f"wall time   {seconds:.1f} s  ({train.get('perf/steps_per_s', float('nan')):.2f} steps/s at the last log)",
  ]
  skipped = loop.history.get("skipped_rounds", [])
  if config.nan_policy == "skip_round":
    lines.append(f"skipped rounds  {len(skipped)} (nan_policy=skip_round)"
                 + (f": steps {', '.join(f'{a}-{b}' for a, b in skipped[:8])}{' ...' if len(skipped) > 8 else ''}"
                    if skipped else ""))
  lines.append("=" * 72)
  return {"text": "\n".join(lines), "eval/loss": last["eval/loss"], "eval/ppl": last["eval/ppl"],
          "eval/loss_first": first["eval/loss"], "replicas/weight_std": last["replicas/weight_std"],
          "comm/bytes_per_replica": comm_bytes, "wall_time_s": seconds, "model/num_params": num_params,
          "outer/skipped_rounds": len(skipped)}


def report(run, seconds: float) -> dict[str, Any]:
  """Prints the summary (process 0), writes WORKDIR/summary.json, and returns it with the final state."""
  summary = summarize(run.config, run.loop, run.setup.model.num_params(), seconds)
  if jax.process_index() == 0:
    print(summary["text"], flush=True)
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "text"}, f, indent=2)
  return {**summary, "state": run.state, "history": run.loop.history}
