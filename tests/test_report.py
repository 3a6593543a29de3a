"""The run report (noloco_jax/report.py): series, times and the summary from metrics.jsonl alone, a PNG,
runs in progress, both names of the bytes metric, and the missing-matplotlib path."""

import json
import os
import sys

import numpy as np
import pytest

from noloco_jax import report

CONFIG = {"num_steps": 12, "num_replicas": 4, "data": {"batch_size": 2, "seq_len": 8}, "outer": {"kind": "noloco"}}


def _write_run(path, rows, *, config=CONFIG, summary=True, tail=""):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write(tail)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if summary:
    with open(os.path.join(path, "summary.json"), "w") as f:
      json.dump({"eval/loss": rows[-1].get("eval/loss")}, f)
  return str(path)


def _rows(bytes_key="comm/bytes_per_replica", received=False, skipped=False):
  rows = [{"step": 0, "model/num_params": 100}, {"step": 0, "eval/loss": 5.0, "eval/ppl": float(np.exp(5.0)),
                                                 "replicas/weight_std": 0.0}]
  for step, rate in ((3, 0.5), (6, 2.0), (9, 4.0), (12, 2.0)):  # the first interval is slow (compilation)
    row = {"step": step, "train/loss": 5.0 - step / 10, "perf/steps_per_s": rate, "outer/round": step // 3,
           bytes_key: 1000 * step, "replicas/weight_std": 1e-3 * step}
    if received:
      row["comm/bytes_received_per_replica"] = 900 * step
    if skipped:
      row["outer/skipped_rounds"] = int(step >= 9)
    rows.append(row)
    if step % 6 == 0:
      rows.append({"step": step, "eval/loss": 4.9 - step / 10, "eval/ppl": float(np.exp(4.9 - step / 10)),
                   "replicas/weight_std": 1e-3 * step, "eval/consensus_loss": 4.85 - step / 10})
  return rows


def test_series_tokens_and_times_against_hand_arithmetic(tmp_path):
  run = report.Run(_write_run(tmp_path / "a", _rows()))
  steps, values, key = run.series("eval/loss")
  assert key == "eval/loss" and steps.tolist() == [0, 6, 12]
  np.testing.assert_allclose(values, [5.0, 4.3, 3.7])
  np.testing.assert_array_equal(run.tokens(np.array([12])), [12 * 4 * 2 * 8])
  # Intervals of 3 steps at 2 (the median of 2, 4, 2 replaces the first, compiling, interval), 2, 4, 2 steps/s.
  np.testing.assert_allclose(run.measured_seconds(np.array([0, 3, 6, 12])), [0, 1.5, 3.0, 3.0 + 0.75 + 1.5])
  # Modelled: + bytes at 1 Gb/s + 1 ms per round.
  got = run.modelled_seconds(np.array([12]), link_gbps=1.0, alpha_s=1e-3)
  np.testing.assert_allclose(got, [5.25 + 12000 * 8 / 1e9 + 4 * 1e-3])
  ddp = report.Run(_write_run(tmp_path / "ddp", _rows(), config={**CONFIG, "outer": {"kind": "ddp"}}))
  # ddp's old operand count (one gradient copy per step) is 1/1.5 of what a ring all-reduce over 4 sends.
  np.testing.assert_allclose(ddp.modelled_seconds(np.array([12]), 1.0, 1e-3), [5.25 + 1.5 * 12000 * 8 / 1e9 + 12e-3])


def test_the_summary_says_what_the_run_did(tmp_path):
  lines = report.summarize(report.Run(_write_run(tmp_path / "a", _rows(skipped=True))))
  text = "\n".join(lines)
  assert lines[0] == "a: noloco, 4 replicas, step 12 of 12 (finished)"
  assert "eval/loss   5.0000 (step 0) -> 3.7000 (step 12), ppl 40.447" in text
  assert "eval/consensus_loss 3.6500 (step 12): -0.0500 against eval/loss" in text
  assert "replicas/weight_std 1.200e-02 (step 12)" in text
  assert "rounds skipped: 1" in text and "tokens: 768 (all replicas)" in text
  assert "bytes on the wire per replica: 0.0 MiB sent, 0.0 MiB received (from comm/bytes_per_replica, the " in text


def test_a_run_in_progress_with_a_half_written_line(tmp_path):
  rows = _rows()[:5]  # up to step 6's train row
  path = _write_run(tmp_path / "live", rows, summary=False, tail='{"step": 9, "train/lo')
  run = report.Run(path)
  assert run.skipped_lines == 1 and run.last_step == 6
  assert report.summarize(run)[0] == "live: noloco, 4 replicas, step 6 of 12 (in progress); 1 unreadable line(s) skipped"


def test_the_new_bytes_names_are_read_first(tmp_path):
  run = report.Run(_write_run(tmp_path / "a", _rows(bytes_key="comm/bytes_sent_per_replica", received=True)))
  text = "\n".join(report.summarize(run))
  assert "sent, 0.0 MiB received (comm/bytes_sent_per_replica)" in text
  assert run.series(*report.BYTES_SENT)[2] == "comm/bytes_sent_per_replica"


def test_an_old_logs_operand_bytes_are_not_shown_as_bytes_on_the_wire(tmp_path):
  """A log from before the wire was counted has only comm/bytes_per_replica, the collectives' operands. An
  all-reduce sends 2(N−1)/N of its operand per replica on a ring (1.5 at N = 4): shown as such, and named."""
  diloco = report.Run(_write_run(tmp_path / "d", _rows(), config={**CONFIG, "outer": {"kind": "diloco"}}))
  steps, sent, source = diloco.wire_series()
  np.testing.assert_allclose(sent, 1.5 * 1000 * steps)
  np.testing.assert_allclose(diloco.wire_series(received=True)[1], sent)
  assert source.startswith("from comm/bytes_per_replica, the collectives' operands") and "× 1.5 for a ring all-reduce over N = 4" in source
  assert f"  bytes on the wire per replica: 0.0 MiB sent, 0.0 MiB received ({source})" in report.summarize(diloco)
  np.testing.assert_allclose(diloco.modelled_seconds(np.array([12]), 1.0, 1e-3), [5.25 + 18000 * 8 / 1e9 + 4e-3])
  noloco = report.Run(_write_run(tmp_path / "n", _rows()))  # its operands are the messages it sends
  np.testing.assert_allclose(noloco.wire_series()[1], 1000 * steps)
  assert "as sent: point-to-point messages" in noloco.wire_series()[2]


def test_main_writes_a_png_per_run_and_per_comparison(tmp_path, capsys):
  pytest.importorskip("matplotlib", reason="needs matplotlib: pip install '.[plots]'")
  a = _write_run(tmp_path / "a", _rows())
  b = _write_run(tmp_path / "b", _rows(bytes_key="comm/bytes_sent_per_replica", received=True, skipped=True))
  assert report.main([a]) == 0
  png = os.path.join(a, "report.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  out = str(tmp_path / "cmp" / "both.png")
  assert report.main([a, b, "--out", out]) == 0
  assert os.path.getsize(out) > 10_000
  printed = capsys.readouterr().out
  assert printed.count("(finished)") == 3 and f"Report: {out}" in printed


def test_without_matplotlib_the_text_still_prints_and_the_png_says_how(tmp_path, capsys, monkeypatch):
  a = _write_run(tmp_path / "a", _rows())
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
  assert report.main([a]) == 0
  captured = capsys.readouterr()
  assert "a: noloco, 4 replicas, step 12 of 12 (finished)" in captured.out
  assert "pip install '.[plots]'" in captured.err and not os.path.exists(os.path.join(a, "report.png"))


def test_bad_input_is_one_line(tmp_path, capsys):
  assert report.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"noloco_jax.report: error: WORKDIR={str(tmp_path)!r} holds no metrics.jsonl: give the --workdir of a "
                 "run (or of an asynchronous job, which holds process_<i>/).")
  assert report.main([str(tmp_path), "--link-gbps", "0"]) == 2
  assert "--link-gbps=0.0 must be > 0" in capsys.readouterr().err


def test_every_run_is_drawn_in_the_spread_panel_and_the_consensus_line_stands_out(tmp_path):
  """Issue 34 item 5: a DiLoCo run (spread 0 at every logged step) vanished from the log-scale spread panel
  without a word, and the consensus-eval line hid under the eval line in the same colour."""
  pytest.importorskip("matplotlib", reason="needs matplotlib: pip install '.[plots]'")
  noloco = _write_run(tmp_path / "noloco", _rows())
  flat = [{k: (0.0 if k == "replicas/weight_std" else v) for k, v in r.items()} for r in _rows()]
  diloco = _write_run(tmp_path / "diloco", flat, config={**CONFIG, "outer": {"kind": "diloco"}})
  fig = report.figure([report.Run(noloco), report.Run(diloco)])
  ax_step, ax_std = fig.axes[0], fig.axes[3]
  spread = {line.get_label(): line for line in ax_std.lines}
  assert set(spread) == {"noloco (noloco)", "diloco (diloco) (0 at every logged step: replicas identical when logged)"}
  assert list(spread["diloco (diloco) (0 at every logged step: replicas identical when logged)"].get_ydata()) == [0.0] * 5
  assert ax_std.get_yscale() == "symlog"  # 0 has a place on the axis
  lines = {line.get_label(): line for line in ax_step.lines}
  for name in ("noloco (noloco)", "diloco (diloco)"):
    eval_line, consensus = lines[f"{name}: eval"], lines[f"{name}: consensus eval"]
    assert eval_line.get_color() != consensus.get_color()
    assert consensus.get_zorder() > eval_line.get_zorder()  # drawn over it
