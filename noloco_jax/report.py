"""A run's report from its metrics.jsonl alone: one PNG per run (or one for a comparison) and a text summary.

    python -m noloco_jax.report WORKDIR [WORKDIR ...] [--out PNG] [--link-gbps 1] [--alpha-ms 1]

Nothing is re-trained or re-evaluated: the figures are the rows the run logged (metrics.jsonl) and the
sizes in its config.json. A run still in progress works: a half-written last line is skipped, and the
summary says which step the run has reached.

The six panels, the modelled wall time (the run's measured compute plus its logged bytes on an α–β link:
on the CPU simulator a figure to compare runs by, not a forecast) and the options: docs/after_a_run.md.
A series that cannot be drawn is named in its panel with the reason. An asynchronous job's workdir
(process_<i>/) is reported as one run: its processes' logs merged (asynchronous/logs.py) and, once
computed, the job's spread and consensus loss (asynchronous/result.py, WORKDIR/summary.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from noloco_jax.asynchronous import logs as async_logs  # pure Python too
from noloco_jax.config import outer as outer_schema  # the methods' specs (registered by the package), no JAX
from noloco_jax.config.outer import OuterConfig

BYTES_SENT = ("comm/bytes_sent_per_replica",)
BYTES_RECEIVED = ("comm/bytes_received_per_replica",)
# Logs written before the wire was counted have only this name, and it held the collectives' operands
# (outer/wire.py): for a method whose collectives are point-to-point messages that is what a replica
# sends and receives, but an all-reduce moves 2(N−1)/N of its operand per replica on a ring. `Run.wire_series`
# converts it by the method's own accounting (its spec's `wire`), and says so.
OLD_OPERANDS = "comm/bytes_per_replica"
PLOTS_HINT = "the PNG needs matplotlib: pip install '.[plots]' (the text summary above needs nothing)"


class ReportError(ValueError):
  """A workdir that cannot be reported on; the message is one line naming it."""


def read_rows(path: str) -> tuple[list[dict], int]:
  """(rows of a metrics.jsonl, lines skipped). A line that does not parse is skipped: the last one is a
  run in progress writing it; any other is counted so the summary can say so."""
  rows, skipped = [], 0
  with open(path, "rb") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        skipped += 1
        continue
      if isinstance(row, dict) and "step" in row:
        rows.append({k: _number(v) for k, v in row.items()})
  return rows, skipped


def _number(v):
  """JSON has no NaN or inf: the writer stores them as strings ("nan", "inf")."""
  if isinstance(v, str):
    try:
      return float(v)
    except ValueError:
      return v
  return v


class Run:
  """One workdir's logged series, as NumPy arrays by step."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.name = os.path.basename(self.workdir.rstrip("/"))
    self.summary = _read_json(os.path.join(self.workdir, "summary.json"))
    self.processes: list[int] = []  # an asynchronous job's processes (empty for a run)
    path = os.path.join(self.workdir, "metrics.jsonl")
    if not os.path.isfile(path) and async_logs.is_job(self.workdir):
      self._read_job()
      return
    if not os.path.isfile(path):
      raise ReportError(f"WORKDIR={workdir!r} holds no metrics.jsonl: give the --workdir of a run (or of an "
                        "asynchronous job, which holds process_<i>/).")
    self.rows, self.skipped_lines = read_rows(path)
    self.config = _read_json(os.path.join(self.workdir, "config.json")) or {}

  def _read_job(self) -> None:
    """An asynchronous job's workdir: its processes' logs merged into the job's series (asynchronous/logs.py),
    and, where the job's result was computed (asynchronous/result.py, WORKDIR/summary.json), its spread
    across processes and its consensus model's loss at the last checkpoints' step."""
    merged = async_logs.merge(self.workdir)
    self.processes = merged["processes"]
    self.rows = [{k: _number(v) for k, v in r.items()} for r in async_logs.job_rows(merged)]
    self.skipped_lines = 0
    self.config = async_logs.job_config(merged)
    if self.summary is not None and self.summary.get("job") == "asynchronous":
      step = max((p.get("checkpoint_step") or 0 for p in self.summary.get("per_process", {}).values()), default=0)
      final = {k: self.summary[k] for k in ("replicas/weight_std", "eval/consensus_loss") if k in self.summary}
      if final:
        self.rows.append({"step": step, **final})
    else:
      self.summary = None  # not the job's result: the job's spread and consensus are not known yet

  def series(self, *keys: str) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(steps, values, key) of the first of `keys` present in any row, rows in step order, one value per
    step (the last logged); empty arrays and None when no row has any of them."""
    for key in keys:
      by_step = {}
      for row in self.rows:
        if key in row and isinstance(row[key], (int, float)):
          by_step[int(row["step"])] = float(row[key])
      if by_step:
        steps = np.array(sorted(by_step))
        return steps, np.array([by_step[s] for s in steps]), key
    return np.zeros(0), np.zeros(0), None

  def wire_series(self, received: bool = False) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(steps, cumulative bytes a replica sent (or received) on the wire, where they come from).

    A log from before the wire was counted holds only OLD_OPERANDS, the collectives' operands: those are
    converted with outer/wire.py's formulas (×1 for messages sent once, ×2(N−1)/N for a ring all-reduce),
    and the source says so, so that no operand count is shown as bytes on the wire.
    """
    steps, values, key = self.series(*(BYTES_RECEIVED if received else BYTES_SENT))
    if key is not None:
      return steps, values, key
    steps, values, key = self.series(OLD_OPERANDS)
    if key is None:
      return steps, values, None
    n = int(self._get("", "num_replicas", 1))
    per_round, per_step = self.traffic(n)
    factor = (per_round + per_step).sent / max((per_round + per_step).operand, 1)
    if factor != 1.0:
      how = f"× {factor:g} for a ring all-reduce over N = {n}"  # the only exchange whose wire is not its operand
    else:
      factor, how = 1.0, "as sent: point-to-point messages"
    return steps, values * factor, f"from {OLD_OPERANDS}, the collectives' operands of a log from before the wire was counted, {how}"

  def _get(self, section: str, name: str, default=None):
    value = self.config.get(section, {}).get(name) if section else self.config.get(name)
    return default if value is None else value

  @property
  def kind(self) -> str:
    return str(self._get("outer", "kind", "?"))

  def traffic(self, num_replicas: int):
    """(one round, one inner step) of a one-byte message of the run's method (its spec's accounting)."""
    outer = OuterConfig(kind=self.kind) if self.kind in outer_schema.METHODS else OuterConfig()
    return outer.spec.wire(1, num_replicas, outer)

  @property
  def num_steps(self) -> int | None:
    return self._get("", "num_steps")

  @property
  def last_step(self) -> int:
    return max((int(r["step"]) for r in self.rows), default=0)

  @property
  def tokens_per_step(self) -> int | None:
    n, b, l = self._get("", "num_replicas"), self._get("data", "batch_size"), self._get("data", "seq_len")
    return int(n * b * l) if None not in (n, b, l) else None

  def tokens(self, steps: np.ndarray) -> np.ndarray | None:
    per = self.tokens_per_step
    return None if per is None else steps * float(per)

  def measured_seconds(self, steps: np.ndarray) -> np.ndarray | None:
    """Compute seconds up to each step: Σ over log intervals of Δsteps ÷ perf/steps_per_s, interpolated.
    The first interval holds the compilation: it is counted at the median rate of the later ones."""
    s, rate, _ = self.series("perf/steps_per_s")
    keep = rate > 0
    s, rate = s[keep], rate[keep]
    if not len(s):
      return None
    if len(rate) > 1:
      rate = np.concatenate([[np.median(rate[1:])], rate[1:]])
    previous = np.concatenate([[0], s[:-1]])
    elapsed = np.concatenate([[0.0], np.cumsum((s - previous) / rate)])
    return np.interp(steps, np.concatenate([[0], s]), elapsed)

  def modelled_seconds(self, steps: np.ndarray, link_gbps: float, alpha_s: float) -> np.ndarray | None:
    """Measured compute + the α–β time of the logged bytes and rounds (the module docstring)."""
    compute = self.measured_seconds(steps)
    if compute is None:
      return None
    bs, sent, _ = self.wire_series()
    wire = np.interp(steps, bs, sent) * 8 / (link_gbps * 1e9) if len(bs) else 0.0
    if self.traffic(2)[1].messages:  # a method that communicates every inner step
      messages = steps.astype(float)
    else:
      rs, rounds, _ = self.series("outer/round")
      messages = np.interp(steps, rs, rounds) if len(rs) else 0.0
    return compute + wire + alpha_s * messages


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


# ---- the text summary ----


def _fmt_bytes(b: float) -> str:
  return f"{b / 2**20:,.1f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def summarize(run: Run, link_gbps: float = 1.0, alpha_s: float = 1e-3) -> list[str]:
  """A few lines about one run: where it is, its losses, spread, bytes, skipped rounds and times."""
  total = run.num_steps
  state = "finished" if run.summary is not None and (total is None or run.last_step >= total) else "in progress"
  head = f"{run.name}: {run.kind}, {run._get('', 'num_replicas', '?')} replicas, step {run.last_step}"
  head += f" of {total}" if total else ""
  lines = [head + f" ({state})" + (f"; {run.skipped_lines} unreadable line(s) skipped" if run.skipped_lines else "")]
  if run.processes:
    lines.append(f"  an asynchronous job of {len(run.processes)} processes: their logs merged (means over the "
                 "processes at each step)" + ("" if run.summary is not None else
                                              "; its spread and consensus model are not computed yet: python -m "
                                              f"noloco_jax.asynchronous.result {run.workdir}"))
  es, ev, _ = run.series("eval/loss")
  if len(es):
    best = int(np.nanargmin(ev)) if np.isfinite(ev).any() else -1
    text = f"  eval/loss   {ev[0]:.4f} (step {es[0]}) -> {ev[-1]:.4f} (step {es[-1]}), ppl {math.exp(min(ev[-1], 700)):.3f}"
    if best >= 0 and best != len(ev) - 1:
      text += f"; best {ev[best]:.4f} at step {es[best]}"
    lines.append(text)
  cs, cv, _ = run.series("eval/consensus_loss")
  if len(cs):
    lines.append(f"  eval/consensus_loss {cv[-1]:.4f} (step {cs[-1]}): {cv[-1] - ev[-1]:+.4f} against eval/loss"
                 if len(es) and es[-1] == cs[-1] else f"  eval/consensus_loss {cv[-1]:.4f} (step {cs[-1]})")
  ts, tv, _ = run.series("train/loss")
  if len(ts):
    lines.append(f"  train/loss  {tv[-1]:.4f} (step {ts[-1]})")
  ws, wv, _ = run.series("replicas/weight_std")
  if len(ws):
    lines.append(f"  replicas/weight_std {wv[-1]:.3e} (step {ws[-1]})")
  bs, bv, key = run.wire_series()
  if len(bs):
    rs, rv, _ = run.wire_series(received=True)
    lines.append(f"  bytes on the wire per replica: {_fmt_bytes(bv[-1])} sent" +
                 (f", {_fmt_bytes(rv[-1])} received" if len(rs) else "") + f" ({key})")
  ss, sv, _ = run.series("outer/skipped_rounds")
  if len(ss):
    lines.append(f"  rounds skipped: {int(sv[-1])}")
  tokens = run.tokens(np.array([run.last_step]))
  if tokens is not None:
    lines.append(f"  tokens: {tokens[0]:,.0f} (all replicas)")
  steps = np.array([run.last_step])
  measured, modelled = run.measured_seconds(steps), run.modelled_seconds(steps, link_gbps, alpha_s)
  if measured is not None:
    lines.append(f"  time: {measured[0]:.1f} s measured compute; {modelled[0]:.1f} s modelled "
                 f"({link_gbps:g} Gb/s, α={alpha_s * 1e3:g} ms)")
  return lines


# ---- the picture ----


def _darker(colour) -> tuple:
  """The same hue at half the brightness: a run's consensus line, told apart from its eval line."""
  import matplotlib.colors  # pylint: disable=g-import-not-at-top  (the `plots` extra)
  return tuple(0.5 * x for x in matplotlib.colors.to_rgb(colour))


def plot(runs: list[Run], out: str, link_gbps: float = 1.0, alpha_s: float = 1e-3) -> str:
  """Six panels for one run or a comparison (one colour per run) into the PNG `out`."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (the `plots` extra)
  fig = figure(runs, link_gbps, alpha_s)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def figure(runs: list[Run], link_gbps: float = 1.0, alpha_s: float = 1e-3):
  """The report's matplotlib figure (`plot` saves it). Every series a run logged is drawn; where one cannot
  be, its panel says which run was left out and why."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (the `plots` extra; see the module docstring)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
  (ax_step, ax_tok, ax_time), (ax_std, ax_bytes, ax_skip) = axes
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  left_out: dict[Any, list[str]] = {}  # panel -> "run: why" of the series it could not draw
  positive = [v[v > 0] for v in (r.series("replicas/weight_std")[1] for r in runs)]
  spread_floor = min((float(p.min()) for p in positive if p.size), default=None)  # the spread axis' linear part
  for i, run in enumerate(runs):
    c = colours[i % len(colours)]
    label = f"{run.name} ({run.kind})" if len(runs) > 1 else run.kind
    es, ev, _ = run.series("eval/loss")
    ts, tv, _ = run.series("train/loss")
    cs, cv, _ = run.series("eval/consensus_loss")
    for ax, x_of, axis in ((ax_step, lambda s: s, "steps"), (ax_tok, run.tokens, "tokens"),
                           (ax_time, lambda s: run.modelled_seconds(s, link_gbps, alpha_s), "modelled time")):
      # The consensus model's loss is often within a hair of eval/loss: its own (darker) colour, drawn on top.
      for steps, values, style, what in ((ts, tv, dict(color=c, lw=1, alpha=0.45), "train"),
                                         (es, ev, dict(color=c, lw=2, marker="o", ms=3), "eval"),
                                         (cs, cv, dict(color=_darker(c), lw=1.5, ls="--", marker="x", ms=5, zorder=3),
                                          "consensus eval")):
        if not len(steps):
          continue
        x = x_of(steps)
        if x is None:
          left_out.setdefault(ax, []).append(f"{run.name}: no {axis} (its config or perf/steps_per_s is missing)")
        else:
          ax.plot(x, values, label=f"{label}: {what}", **style)
    ws, wv, _ = run.series("replicas/weight_std")
    if len(ws):
      # A symmetric-log axis (below): a spread of 0 (identical replicas: step 0, or a method that averages
      # every replica at its logged steps, as DiLoCo does) is drawn at 0, not dropped as a log axis would.
      zero = " (0 at every logged step: replicas identical when logged)" if not (wv > 0).any() else ""
      ax_std.plot(ws, wv, color=c, marker=".", label=label + zero)
    elif run.processes:
      left_out.setdefault(ax_std, []).append(f"{run.name}: an asynchronous job whose result is not computed "
                                             "(python -m noloco_jax.asynchronous.result WORKDIR)")
    bs, bv, key = run.wire_series()
    if len(bs):
      ax_bytes.plot(bs, bv / 2**20, color=c, label=f"{label}: sent" + ("" if key in BYTES_SENT else f" ({OLD_OPERANDS} converted)"))
    rs, rv, rkey = run.wire_series(received=True)
    if len(rs) and rkey in BYTES_RECEIVED:  # an old log's received bytes are its sent ones: drawn once
      ax_bytes.plot(rs, rv / 2**20, color=c, ls=":", label=f"{label}: received")
    ss, sv, _ = run.series("outer/skipped_rounds")
    if len(ss):
      ax_skip.step(ss, sv, where="post", color=c, label=label)
  titles = [(ax_step, "Loss vs inner steps", "inner step", "loss (nats)"),
            (ax_tok, "Loss vs training tokens (all replicas)", "tokens", "loss (nats)"),
            (ax_time, f"Loss vs modelled wall time ({link_gbps:g} Gb/s, α={alpha_s * 1e3:g} ms)", "seconds", "loss (nats)"),
            (ax_std, "Cross-replica weight std", "inner step", "replicas/weight_std"),
            (ax_bytes, "Bytes on the wire per replica (cumulative)", "inner step", "MiB"),
            (ax_skip, "Rounds skipped (nan_policy=skip_round)", "inner step", "rounds")]
  for ax, title, xlabel, ylabel in titles:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
    else:
      ax.text(0.5, 0.5, "not logged by this run" if len(runs) == 1 else "not logged by these runs",
              ha="center", va="center", transform=ax.transAxes, color="grey")
    if left_out.get(ax):
      ax.text(0.01, 0.01, "left out: " + "; ".join(left_out[ax]), transform=ax.transAxes, fontsize=6,
              color="grey", va="bottom", wrap=True)
  if ax_std.lines:
    # Logarithmic above the smallest positive spread logged, linear below it, so 0 is on the axis.
    ax_std.set_yscale("symlog", linthresh=spread_floor or 1e-6)
    ax_std.set_ylim(bottom=0)
  names = ", ".join(r.name for r in runs)
  progress = [r for r in runs if r.summary is None]
  fig.suptitle(f"noloco_jax report: {names}" + (" (in progress)" if progress else ""), fontsize=12)
  fig.tight_layout()
  return fig


def default_out(workdirs: list[str]) -> str:
  """WORKDIR/report.png for one run; report_comparison.png in the current directory for several."""
  return os.path.join(workdirs[0], "report.png") if len(workdirs) == 1 else "report_comparison.png"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m noloco_jax.report", description=__doc__.split("\n")[0])
  p.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="one run, or several to compare")
  p.add_argument("--out", default=None, help="the PNG (default: WORKDIR/report.png; report_comparison.png for several)")
  p.add_argument("--link-gbps", type=float, default=1.0, help="link bandwidth of the modelled wall time, Gb/s")
  p.add_argument("--alpha-ms", type=float, default=1.0, help="latency per message of the modelled wall time, ms")
  p.add_argument("--no-png", dest="png", action="store_false", help="the text summary only")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.link_gbps <= 0 or args.alpha_ms < 0:
    print(f"noloco_jax.report: error: --link-gbps={args.link_gbps} must be > 0 and --alpha-ms={args.alpha_ms} "
          ">= 0.", file=sys.stderr)
    return 2
  start = time.perf_counter()
  try:
    runs = [Run(w) for w in args.workdirs]
  except ReportError as e:
    print(f"noloco_jax.report: error: {e}", file=sys.stderr)
    return 2
  alpha_s = args.alpha_ms / 1e3
  for run in runs:
    print("\n".join(summarize(run, args.link_gbps, alpha_s)))
  if not args.png:
    return 0
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print(f"noloco_jax.report: {PLOTS_HINT}", file=sys.stderr)
    return 0
  out = plot(runs, args.out or default_out(args.workdirs), args.link_gbps, alpha_s)
  print(f"Report: {out} ({time.perf_counter() - start:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
