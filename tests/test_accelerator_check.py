"""scripts/accelerator_check.sh: its --cpu mode end to end (every section's figures present and sane), so
that the command a lent GPU runs cannot rot; and its parts: a failing or overlong section is recorded in
one line while the check goes on, and the offline install picks only the wheels a machine needs."""

import argparse
import json
import math
import os
import subprocess
import sys
import zipfile

import jax
import pytest

from experiments.lib import accelerator_check as check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_mode_runs_every_section_and_writes_sane_figures(tmp_path):
  out = tmp_path / "check.json"
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # as a user runs it
  done = subprocess.run(["bash", "scripts/accelerator_check.sh", "--cpu", "--no-install", f"--out={out}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["status"] == "ok" and report["mode"] == "cpu"
  assert list(report["sections"]) == [s.name for s in check.SECTIONS]
  for name, section in report["sections"].items():
    assert section["status"] == "ok", (name, section)
    assert f"   {name}: " in done.stdout  # its figures were printed as it went
  log = (tmp_path / "check.log").read_text()
  assert log.count("\n$ ") == len(check.SECTIONS)  # every section's command and output are in the log
  s = {name: section["figures"] for name, section in report["sections"].items()}

  env_ = s["environment"]
  assert env_["backend"] == "cpu" and env_["device_count"] >= 1 and env_["packages"]["jax"] == jax.__version__
  assert env_["requirements"]["jax"]["found"] == jax.__version__
  assert all(r["in_range"] for r in env_["requirements"].values()), env_["requirements"]

  smoke = s["smoke"]
  assert math.isfinite(smoke["eval_loss"]) and smoke["eval_loss"] < smoke["eval_loss_first"]
  assert 0 < smoke["train_wall_s"] < smoke["process_wall_s"] and smoke["bytes_sent_per_replica"] > 0

  for name, remat in (("mfu_small", False), ("mfu_medium", True)):
    mfu = s[name]
    assert mfu["dtype"] == "bfloat16" and mfu["remat"] is remat and mfu["num_params"] > 0
    for side in (mfu, mfu["plain"]):
      assert side["step_s"] > 0
      assert side["tokens_per_s"] == pytest.approx(mfu["batch"] * mfu["seq_len"] / side["step_s"])
      assert side["dry_run_peak_gib"] > 0
      assert side["mfu"] is None and side["peak_gib"] is None  # XLA:CPU: no peak FLOP/s, no memory statistics

  inner = s["inner_replicas"]
  assert inner["replicas"] == 4 and inner["devices"] == 1 and inner["auto_resolves_to"] in ("vmap", "sequential")
  assert inner["vmap_step_s"] > 0 and inner["sequential_step_s"] > 0 and inner["separate_calls_step_s"] > 0
  assert inner["loop_over_vmap"] == pytest.approx(inner["vmap_step_s"] / inner["sequential_step_s"])

  outer = s["outer_rounds"]
  assert outer["replicas"] == 4 and set(outer["rounds"]) == {"lockstep", "overlapped"}
  assert outer["rounds"]["overlapped"]["programs"] == ["exchange", "merge", "message"]
  for r in outer["rounds"].values():
    assert r["round_ms"] > 0 and r["bytes_accessed_per_device"] > 0
    # NoLoCo with n = 2 and float32 messages sends one model copy per round.
    assert r["bytes_sent_per_replica"] == r["model_bytes_f32"] > 0

  exchange = s["async_exchange"]
  assert exchange["both_received_what_was_sent"] and exchange["exit_statuses"] == [0, 0]
  assert exchange["platform"] == exchange["received_on"] == "cpu"
  assert exchange["bytes_each_way"] == exchange["message_mb"] * 2 ** 20
  assert exchange["first_exchange_s"] > 0 and exchange["steady_median_s"] > 0 and exchange["mb_per_s_each_way"] > 0
  assert exchange["transport_stats"]["exchanges"] == exchange["reps"] + 1 and exchange["transport_stats"]["failures"] == 0


def _section(name, run, retry_flags=(), cap_s=30):
  return check.Section(name, (cap_s, cap_s), run, lambda figures: json.dumps(figures), retry_flags=retry_flags)


def _args(tmp_path, **kw):
  return argparse.Namespace(**{"cpu": True, "out": str(tmp_path / "r.json"), "overwrite": False, "budget_s": 120,
                               "json": False, "only": "", **kw})


def test_a_failing_or_overlong_section_is_one_line_and_the_check_goes_on(tmp_path, capsys):
  tries = []

  def fails(ctx, extra):
    tries.append(extra)
    ctx.run([sys.executable, "-c", "import sys; print('working'); sys.exit('ValueError: the thing broke')"])

  def hangs(ctx, extra):
    ctx.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])

  sections = (_section("environment", lambda ctx, extra: {"figures": {"backend": "cpu"}}),
              _section("fails", fails, retry_flags=("--other",)), _section("hangs", hangs, cap_s=1),
              _section("fine", lambda ctx, extra: {"figures": {"x": 1}}))
  assert check.drive(_args(tmp_path), sections) == 1
  report = json.loads((tmp_path / "r.json").read_text())
  got = report["sections"]
  assert tries == [[], ["--other"]]  # tried again with the retry flags
  assert got["fails"]["status"] == "error" and got["fails"]["error"] == "exit status 1: ValueError: the thing broke"
  assert len(got["fails"]["errors"]) == 2
  assert got["hangs"]["status"] == "error" and got["hangs"]["error"].startswith("stopped after 1 s")
  assert got["hangs"]["error"].endswith("last output: started") and got["hangs"]["seconds"] < 20
  assert got["fine"]["figures"] == {"x": 1} and got["fine"]["status"] == "ok"
  assert report["status"] == "failed: fails, hangs"
  printed = capsys.readouterr().out
  assert "   fails FAILED: exit status 1: ValueError: the thing broke" in printed and '   fine: {"x": 1}' in printed


def test_without_a_working_environment_nothing_else_runs(tmp_path):
  def environment(ctx, extra):
    raise check.SectionError("JAX's backend is 'cpu', not gpu")

  ran = []
  sections = (_section("environment", environment), _section("next", lambda ctx, extra: ran.append(1)))
  assert check.drive(_args(tmp_path), sections) == 1
  got = json.loads((tmp_path / "r.json").read_text())["sections"]
  assert got["environment"]["error"] == "JAX's backend is 'cpu', not gpu"
  assert got["next"]["status"] == "skipped" and not ran
  assert json.loads((tmp_path / "r.json").read_text())["status"] == "failed: environment; skipped: next"


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
  (tmp_path / "r.json").write_text("{}")
  for argv, words in ((["--only=mfu_huge"], "no section mfu_huge"), ([f"--out={tmp_path / 'r.json'}"], "exists")):
    done = subprocess.run([sys.executable, "-m", "experiments.lib.accelerator_check", "--cpu", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1
  done = subprocess.run(["bash", "scripts/accelerator_check.sh", "--offline-wheels", str(tmp_path / "none")], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and done.stderr.strip() == f"accelerator_check: --offline-wheels={tmp_path / 'none'} is not a directory."


def _wheel(directory, name, version, requires=()):
  path = directory / f"{name}-{version}-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *[f"Requires-Dist: {r}" for r in requires]]))
  return str(path)


def test_the_offline_install_takes_only_the_wheels_a_machine_needs(tmp_path, monkeypatch, capsys):
  installed = {"flax": "0.11.0", "jax": "0.11.2", "numpy": "2.0.0", "absl-py": "2.0.0"}  # the machine's
  monkeypatch.setattr(check, "_version", installed.get)
  flax = _wheel(tmp_path, "flax", "0.12.12", ["jax>=0.11.1", "numpy>=1.23"])  # the machine's is outside setup.py's range
  new = _wheel(tmp_path, "newpkg", "1.0", ["absl-py>=3", "ghost>=1", "other; extra == 'docs'"])  # missing
  absl = _wheel(tmp_path, "absl_py", "3.1")  # the machine's is too old for newpkg
  _wheel(tmp_path, "numpy", "9.0")  # the machine's is in range and nothing asks for another
  assert check.wheels_to_install(str(tmp_path)) == [absl, flax, new]
  err = capsys.readouterr().err
  assert "installing flax 0.12.12 (0.11.0 is outside setup.py's <0.13,>=0.12)" in err
  assert "installing absl-py 3.1 (2.0.0; newpkg 1.0 wants absl-py>=3)" in err
  assert "keeping this Python's numpy 2.0.0 (carried: 9.0)" in err
  assert "WARNING, no wheel carried for it: missing; newpkg 1.0 wants ghost>=1" in err


def test_a_check_stopped_from_outside_keeps_what_it_measured(tmp_path):
  out = tmp_path / "r.json"
  proc = subprocess.Popen([sys.executable, "-m", "experiments.lib.accelerator_check", "--cpu", "--only=smoke", f"--out={out}"],
                          cwd=REPO, stdout=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if line.startswith("== smoke"):
      proc.terminate()  # SIGTERM, as a machine's time limit sends it
      break
  assert proc.wait(timeout=60) == 130
  report = json.loads(out.read_text())
  assert report["status"] == "stopped" and report["sections"]["environment"]["status"] == "ok"
  assert report["sections"]["smoke"]["error"].startswith("the check was stopped from outside")
