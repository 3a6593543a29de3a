"""The end-of-run summary: the one screen printed when a run ends, and what WORKDIR/summary.json holds.

Every figure in it is one that metrics.jsonl holds too. The training loss is read back from
metrics.jsonl's last training row: in a multi-process job without `log_barrier` each process only
knows its own replicas' loss, and process 0's merged row (io/process_metrics.py) is the job's. A
process that reads metrics.jsonl before process 0 has written that row (any process but 0, which
prints nothing) falls back to its own replicas and says so in `train/loss_over`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

from noloco_jax.config.outer import OuterConfig
from noloco_jax.training.loop_state import LoopState

# How the summary writes each outer hyperparameter (a method's spec: `reads`, noloco_jax/outer/methods/).
SYMBOLS = {"outer_momentum": "α", "outer_lr": "β", "consensus_weight": "γ", "group_size": "n", "fanout": "s",
           "inner_steps": "H", "nesterov": "nesterov"}


def last_train_row(workdir: str, step: int) -> dict[str, Any] | None:
  """metrics.jsonl's training row of `step` (the last one), or None when it is not there (yet)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  row = None
  with open(path) as f:
    for line in f:
      if line.strip():
        parsed = json.loads(line)
        if "train/loss" in parsed:
          row = parsed
  return row if row is not None and row["step"] == step else None


def exchange_in_force(config) -> dict[str, Any]:
  """{field: value} of how the run's kind exchanges: what travels and between whom (none for `none`).

  What its spec says its round reads (message dtype, the epidemic graph, the algorithm the wire figures
  assume for an all-reduce), the codec and overlap window of a method given in parts, the pairing mode of a
  method with a schedule, or with the asynchronous schedule (docs/async.md) what shapes its pairing and
  update at run time (wait budget, batching window, staleness decay, odd batches).
  """
  o = OuterConfig.parse(config.outer)
  spec, c, a = o.spec, o.codec, o.asynchronous
  out: dict[str, Any] = {}
  if "message_dtype" in spec.exchange:
    out["message_dtype"] = c.message_dtype
  if spec.parts:
    out["compression"] = c.compression
    if c.compression == "coset":  # no chunks, no feedback: its own fields (outer/coset.py)
      out.update(coset_mode=c.coset_mode, coset_order=c.coset_order, coset_density=c.coset_density,
                 coset_bits=c.coset_bits, coset_block=c.coset_block)
    elif c.compression != "none":
      out.update(compression_chunk=c.chunk, feedback_decay=c.feedback_decay)
    if c.compression == "topk":
      out.update(topk_density=c.topk_density, topk_bits=c.topk_bits, slow_codec=c.slow_codec)
  if "topology" in spec.exchange:
    out["topology"] = o.rule.topology
  if spec.schedule is not None:
    if o.schedule == "async":
      out.update(schedule="async", max_wait_s=a.max_wait_s, match_window_s=a.match_window_s,
                 staleness_decay=a.staleness_decay, match_odd=a.match_odd)
    else:
      out["pairing"] = o.pairing
  if spec.parts:
    out["overlap_steps"] = o.overlap.steps
    if o.overlap.steps:
      out["overlap_mix"] = o.overlap.mix
  if "allreduce_algorithm" in spec.exchange:
    out["allreduce_algorithm"] = o.rule.allreduce_algorithm
  return out


def _outer_line(config, in_force: dict[str, Any]) -> str:
  """The method's line: its hyperparameters (whose values were its defaults, and whether those are the
  paper's), what its spec adds, then how it exchanges."""
  outer = OuterConfig.parse(config.outer)
  spec = outer.spec
  kind = spec.kind
  cells = []
  for name, value in in_force.items():
    if name == "nesterov":
      text = "Nesterov" if value else "heavy-ball"
    else:
      text = f"{SYMBOLS[name]}={value:g}"
    if name in spec.fixed:
      text += f" (fixed by {kind})"
    elif spec.defaults.get(name) == value:
      text += " (paper)" if spec.in_paper else f" (default for {kind}; not in the paper)"
    cells.append(text)
  cells += spec.cells(outer)
  exchange = exchange_in_force(config)
  if "pairing" in exchange:
    cells.append(f"pairing {exchange['pairing']}")
  if exchange.get("schedule") == "async":
    cells.append(f"schedule async (partners at run time: max_wait_s={exchange['max_wait_s']:g}, "
                 f"match_window_s={exchange['match_window_s']:g}, staleness_decay={exchange['staleness_decay']:g}, "
                 f"match_odd={exchange['match_odd']})")
  if "message_dtype" in exchange:
    codec = exchange.get("compression", "none")
    details = [f"{k}={exchange[k]:g}" if isinstance(exchange[k], float) else f"{k}={exchange[k]}"
               for k in ("topk_density", "topk_bits", "slow_codec", "compression_chunk", "feedback_decay", "coset_mode",
                         "coset_order", "coset_density", "coset_bits", "coset_block") if k in exchange]
    text = f"messages {exchange['message_dtype']}"
    if codec != "none":
      text += f", {codec}" + (f" ({', '.join(details)})" if details else "")
    cells.append(text)
  if exchange.get("overlap_steps"):
    cells.append(f"overlap τ={exchange['overlap_steps']}, λ={exchange['overlap_mix']:g}")
  if "allreduce_algorithm" in exchange:
    cells.append(f"all-reduce priced as {exchange['allreduce_algorithm']}")
  return f"outer {kind}: " + (", ".join(cells) if cells else "no outer step")


def _start_line(workdir: str, start_step: int, config) -> str:
  if start_step:
    how = f"resumed from its checkpoint at step {start_step}"
  elif config.checkpoint.warm_start:
    how = f"warm start from {config.checkpoint.warm_start}"
  else:
    how = "started from scratch"
  return f"workdir     {workdir} ({how})"


def _spread_line(config, weight_std: float) -> str:
  """The cross-replica spread; a run of one replica has none to measure, and says so rather than print a 0
  that reads as agreement (a process of an asynchronous job: the job's spread is its result's)."""
  if config.num_replicas > 1:
    return f"replicas/weight_std  {weight_std:.3e}"
  if config.outer.schedule == "async":
    return ("replicas/weight_std  none here (this process holds one replica); the job's spread across its processes "
            "and its consensus model: the job's summary (python -m noloco_jax.asynchronous.result JOB_WORKDIR)")
  return "replicas/weight_std  none (one replica: nothing to spread)"


def _mib(x: float) -> str:
  return f"{x:,.0f} ({x / 2 ** 20:.1f} MiB)"


def summarize(config, loop: LoopState, num_params: int, seconds: float, workdir: str,
              start_step: int = 0) -> dict[str, Any]:
  """The end-of-run summary: {"text": the printed screen, and the scalars summary.json holds}.

  `start_step`: the step the run resumed from (0: it did not resume).
  """
  evals = loop.history["eval"]
  first, last = evals[0], evals[-1]
  row = last_train_row(workdir, loop.step)
  over = "all replicas (metrics.jsonl)" if row is not None else "this process's replicas"
  train = row if row is not None else loop.history.get("train", {})
  loss = float(train.get("train/loss", math.nan))
  comm = {"comm/bytes_sent_per_replica": loop.bytes_sent, "comm/bytes_received_per_replica": loop.bytes_received,
          "comm/collective_operand_bytes_per_replica": loop.comm_bytes}
  in_force = OuterConfig.parse(config.outer).in_force()
  rounds_h = f" | H={config.outer.inner_steps}" if "inner_steps" in in_force else ""
  lines = [
      "=" * 72,
      f"noloco_jax: {config.outer.kind} | {config.num_replicas} replicas | {config.num_steps} steps{rounds_h} "
      f"| model {config.model.arch} {config.model.preset} ({num_params:,} params per replica)",
      _outer_line(config, in_force),
      _start_line(workdir, start_step, config),
      f"eval/loss   {first['eval/loss']:.4f} (step {first['step']}) -> {last['eval/loss']:.4f} (step {last['step']})",
      f"eval/ppl    {last['eval/ppl']:.3f}",
      *([f"eval/consensus_loss  {last['eval/consensus_loss']:.4f} (the replicas' average, "
         f"eval_consensus={config.eval_consensus}; {last['eval/consensus_loss'] - last['eval/loss']:+.4f} against eval/loss)"]
        if "eval/consensus_loss" in last else []),
      f"train/loss  {loss:.4f} (step {train.get('step', loop.step)}, {over})",
      _spread_line(config, last["replicas/weight_std"]),
      f"comm/bytes_sent_per_replica      {_mib(comm['comm/bytes_sent_per_replica'])} on the wire",
      f"comm/bytes_received_per_replica  {_mib(comm['comm/bytes_received_per_replica'])} on the wire",
      f"comm/collective_operand_bytes_per_replica  {_mib(comm['comm/collective_operand_bytes_per_replica'])}",
      f"wall time   {seconds:.1f} s  ({float(train.get('perf/steps_per_s', math.nan)):.2f} steps/s at the last log)",
  ]
  skipped = loop.history.get("skipped_rounds", [])
  if config.nan_policy == "skip_round":
    lines.append(f"skipped rounds  {len(skipped)} (nan_policy=skip_round)"
                 + (f": steps {', '.join(f'{a}-{b}' for a, b in skipped[:8])}{' ...' if len(skipped) > 8 else ''}"
                    if skipped else ""))
  lines.append("=" * 72)
  consensus = {k: last[k] for k in ("eval/consensus_loss", "eval/consensus_ppl") if k in last}
  return {"text": "\n".join(lines), "eval/loss": last["eval/loss"], "eval/ppl": last["eval/ppl"], **consensus,
          "eval/loss_first": first["eval/loss"], "train/loss": loss, "train/loss_over": over,
          "replicas/weight_std": last["replicas/weight_std"], **comm,
          "outer/kind": config.outer.kind, "outer": in_force, "outer/exchange": exchange_in_force(config),
          "outer/allreduce_algorithm": config.outer.rule.allreduce_algorithm,
          "workdir": os.path.abspath(workdir), "resumed_from_step": start_step,
          "warm_start": config.checkpoint.warm_start or None,
          "wall_time_s": seconds, "model/num_params": num_params, "outer/skipped_rounds": len(skipped)}


def report(run, seconds: float) -> dict[str, Any]:
  """Prints the summary (process 0), writes WORKDIR/summary.json, and returns it with the final state."""
  summary = summarize(run.config, run.loop, run.setup.model.num_params(), seconds, run.workdir, run.start_step)
  if jax.process_index() == 0:
    print(summary["text"], flush=True)
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "text"}, f, indent=2)
  run.writer.write_summary({k: v for k, v in summary.items() if k != "text"})  # e.g. the W&B run's summary
  return {**summary, "state": run.state, "history": run.loop.history}
