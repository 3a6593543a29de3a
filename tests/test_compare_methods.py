"""experiments/compare_methods.py: the tables print without matplotlib, and runs keep their plots to
themselves unless asked to refresh the committed figures."""

import json
import os

import pytest

from experiments import compare_methods

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plots_go_to_the_runs_own_directory_unless_asked_for_the_committed_ones():
  committed = os.path.join(REPO, "experiments", "plots")
  assert compare_methods.plot_dir_of(compare_methods.parse_args([])) == os.path.join(
      REPO, "runs", "compare_methods", "plots")
  assert compare_methods.plot_dir_of(compare_methods.parse_args(["--workdir", "/tmp/w"])) == "/tmp/w/plots"
  assert compare_methods.plot_dir_of(compare_methods.parse_args(["--refresh-committed-plots"])) == committed


def test_the_tables_print_without_matplotlib(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
  monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # `import matplotlib` raises ImportError
  summary = compare_methods.main(["--smoke", "--seeds", "0", "--methods", "diloco", "noloco", "--json",
                                  "--workdir", str(tmp_path)])
  out = capsys.readouterr().out
  assert "| setting |" in out and "| method | H | rounds | sent (wire)" in out
  assert "plots: skipped, matplotlib is not installed" in out
  assert summary["plots"] == [] and json.loads(out.strip().splitlines()[-1])["plots"] == []
  # What each run logged on the wire (outer/wire.py through OuterMethod.message_bytes) is what the
  # script's model computes from the parameter count: DiLoCo's ring all-reduce 1.75 copies a round.
  for kind, m in summary["methods"].items():
    assert m["bytes_sent_per_replica"] == pytest.approx(m["sent_bytes_per_replica_modelled"], rel=1e-12), kind
  copy = 4 * summary["params_per_replica"]
  assert summary["methods"]["diloco"]["bytes_sent_per_replica"] == pytest.approx(2 * 2 * 7 / 8 * copy)  # 2 rounds
  assert summary["methods"]["diloco"]["collective_operand_bytes_per_replica"] == 2 * copy
