"""Every ablation notebook runs top to bottom (NOLOCO_SMOKE=1 sizes), and so does compare_methods.py.

Each notebook is executed with nbclient in a fresh kernel that runs this interpreter (a kernel spec
written to a temporary JUPYTER_PATH, so that no installed "python3" spec pointing at another Python
can be picked up). Smoke sizes keep a run to seconds; the whole module takes about a minute or two on
two CPU cores, most of it compiling.
"""

import glob
import importlib.util
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "experiments", "ablations", "*.ipynb")))
KERNEL = "noloco-test-python"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


@pytest.fixture
def smoke_env(tmp_path, monkeypatch):
  """NOLOCO_SMOKE=1 and a kernel spec for this interpreter; the kernel inherits this environment."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "noloco_jax tests", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("NOLOCO_SMOKE", "1")
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  return tmp_path


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 3, NOTEBOOKS


# Notebook 02 stays in the default run: the same experiment library, sweeps, tables and figures as the others.
_ONE_NOTEBOOK_RUNS = "02_gamma_stability.ipynb"


@pytest.mark.parametrize("path", [
    p if os.path.basename(p) == _ONE_NOTEBOOK_RUNS else pytest.param(p, marks=pytest.mark.exhaustive(
        reason=f"a notebook end to end ({_ONE_NOTEBOOK_RUNS} stays in: the same library, sweeps, tables, figures)"))
    for p in NOTEBOOKS], ids=os.path.basename)
def test_notebook_runs_in_smoke_mode(path, smoke_env):
  book = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(book, timeout=600, kernel_name=KERNEL,
                                   resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()  # raises CellExecutionError, naming the cell, on the first failing cell
  outputs = [o for cell in book.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "smoke=True" in text, "the notebook did not pick up NOLOCO_SMOKE=1"
  assert "| setting |" in text, "the notebook printed no results table"
  assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook drew no figure"


@pytest.mark.exhaustive(reason="compare_methods end to end: tests/test_compare_methods.py runs it too")
def test_compare_methods_smoke_json(smoke_env, capsys):
  spec = importlib.util.spec_from_file_location("compare_methods", os.path.join(REPO, "experiments", "compare_methods.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  workdir = smoke_env / "compare"
  module.main(["--smoke", "--seeds", "0", "--json", "--workdir", str(workdir)])
  last = capsys.readouterr().out.strip().splitlines()[-1]
  summary = json.loads(last)
  assert set(summary["methods"]) == {"ddp", "diloco", "noloco"}
  for kind, m in summary["methods"].items():
    assert math.isfinite(m["eval_loss_mean"]) and m["eval_loss_mean"] < math.log(257), kind  # it learned
  assert summary["methods"]["ddp"]["weight_std_final_mean"] == 0.0
  assert summary["methods"]["noloco"]["weight_std_final_mean"] > 0.0  # pairs, not a global mean
  # DDP communicates every step, the others once per round.
  assert summary["methods"]["ddp"]["comm_s_per_step"] > 0 == summary["methods"]["noloco"]["comm_s_per_step"]
  assert summary["paper_metric_diloco_minus_noloco_over_ddp_ppl"]["percent_per_seed"]
  for path in summary["plots"]:
    assert os.path.getsize(os.path.join(REPO, path)) > 0
