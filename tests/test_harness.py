"""experiments/lib/harness.py: config overrides and their one-line errors, the final JSON line, quick
mode and fake devices; then every script under experiments/ is on the harness and answers --help, run
both as a file and as a module (cheap: the harness parses flags before any JAX work)."""

import ast
import glob
import json
import os
import subprocess
import sys

import pytest

from experiments.lib import harness
from noloco_jax.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _usage_error(capsys, bench, argv) -> str:
  """The one line a usage error prints, after checking it exits with status 2."""
  with pytest.raises(SystemExit) as exit_info:
    bench.parse(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  return err


# ---- Config overrides ----


def test_overrides_are_typed_by_the_schema_and_applied_after_the_scripts_own_settings():
  bench = harness.Bench(None, config=True)
  bench.parse(["--config.num_steps=7", "--config.model.remat=true", "--config.inner.lr=0.5",
               "--config.outer.kind=diloco", "--config.data.mode=stream"])
  cfg = bench.config()
  cfg.outer.kind = "none"  # a script's own setting: the command line's override wins
  bench.override(cfg)
  assert (cfg.num_steps, cfg.model.remat, cfg.inner.lr, cfg.outer.kind, cfg.data.mode) == (
      7, True, 0.5, "diloco", "stream")
  assert isinstance(cfg.inner.lr, float) and cfg.model.remat is True
  assert bench.overrides() == ["num_steps=7", "model.remat=true", "inner.lr=0.5", "outer.kind=diloco",
                               "data.mode=stream"]


def test_config_file_and_argument_string():
  bench = harness.Bench(None, config=True)
  bench.parse(["--config=configs/default.py:smoke"])
  assert bench.config().num_steps == 12  # the smoke argument of configs/default.py
  bench.parse([])
  assert bench.config().num_steps == harness.load_config("configs/default.py").num_steps != 12


def test_renamed_field_is_accepted_under_its_old_name():
  from noloco_jax import config as schema
  bench = harness.Bench(None, config=True)
  bench.parse(["--config.outer.momentum=0.25"])  # the old name of outer.rule.outer_momentum
  assert schema.load(bench.override(bench.config())).outer.rule.outer_momentum == 0.25


def test_extra_groups_apply_on_top_of_the_common_overrides():
  bench = harness.Bench(None, config=True, groups=("a", "b"))
  bench.parse(["--config.num_steps=3", "--a.num_steps=4", "--b.seed=9"])
  a = bench.override(bench.config(), "config", "a")
  b = bench.override(bench.config(), "config", "b")
  assert (a.num_steps, a.seed) == (4, 0) and (b.num_steps, b.seed) == (3, 9)
  assert bench.overrides("a") == ["num_steps=4"]


@pytest.mark.parametrize("arg, line", [
    ("--config.outer.momentun=0.9",
     "noloco_jax: config.outer.momentun is not a field; did you mean config.outer.rule.outer_momentum?"),
    ("--config.num_steps=abc", "noloco_jax: config.num_steps='abc' is not valid: an integer."),
    ("--config.model.remat=maybe", "noloco_jax: config.model.remat='maybe' is not valid: True or False."),
    ("--config.inner.lr=fast", "noloco_jax: config.inner.lr='fast' is not valid: a number."),
    ("--config.num_steps", "noloco_jax: --config.num_steps needs a value: --config.num_steps=VALUE."),
    ("--config=configs/none.py", "noloco_jax: --config=configs/none.py: cannot load it: no file configs/none.py."),
])
def test_a_bad_override_is_one_line_and_exit_status_2(capsys, arg, line):
  bench = harness.Bench(None, config=True)
  if arg.startswith("--config="):
    bench.parse([arg])
    with pytest.raises(SystemExit) as exit_info:
      bench.config()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == line
  else:
    assert _usage_error(capsys, bench, [arg]) == line


def test_a_section_is_not_a_field(capsys):
  err = _usage_error(capsys, harness.Bench(None, config=True), ["--config.model=3"])
  assert err.startswith("noloco_jax: config.model is a section, not a field; its fields are ")
  assert "num_layers" in err


def test_a_group_the_script_does_not_declare_is_not_an_override(capsys):
  with pytest.raises(SystemExit) as exit_info:
    harness.Bench(None, config=True).parse(["--a.num_steps=3"])
  assert exit_info.value.code == 2
  assert "unrecognized arguments: --a.num_steps=3" in capsys.readouterr().err


def test_run_turns_a_config_error_from_the_build_into_the_one_line_error(capsys):
  def main():
    raise ConfigError("config.num_replicas=3 is not valid: a multiple of config.num_devices (2).")
  with pytest.raises(SystemExit) as exit_info:
    harness.run(main)
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == "noloco_jax: config.num_replicas=3 is not valid: a multiple of config.num_devices (2).\n"


# ---- The JSON line ----


def test_json_is_the_last_line_of_stdout_with_the_machine_and_the_text_goes_to_stderr(capsys):
  bench = harness.Bench(None)
  bench.parse(["--json"])
  bench.note("progress")
  returned = bench.finish({"step_s": 0.5}, text=lambda r: f"{r['step_s']} s/step")
  out, err = capsys.readouterr()
  assert out.endswith("\n") and len(out.splitlines()) == 1
  result = json.loads(out)
  assert result == returned
  assert list(result) == ["benchmark", "step_s", "machine"] and result["benchmark"] == "test_harness"
  machine = result["machine"]
  assert machine["cpu_count"] == os.cpu_count() and len(machine["load_avg"]) == 3 and len(machine["load_avg_start"]) == 3
  assert machine["jax_version"] == __import__("jax").__version__
  assert machine["backend"] in (None, "cpu", "gpu", "tpu")
  assert err == "progress\n0.5 s/step\n"


def test_without_json_the_text_form_alone_or_else_the_json_line(capsys):
  bench = harness.Bench(None)
  bench.parse([])
  bench.finish({"benchmark": "mine", "x": 1}, text=lambda r: f"x = {r['x']}")
  assert capsys.readouterr() == ("x = 1\n", "")
  bench.finish({"x": 1})  # no text form: the JSON line
  result = json.loads(capsys.readouterr().out)
  assert result["x"] == 1 and "machine" in result


def test_out_also_writes_the_result_to_a_file(tmp_path, capsys):
  bench = harness.Bench(None, out=True)
  bench.parse([f"--out={tmp_path / 'r.json'}"])
  bench.finish({"x": 2})
  assert json.loads((tmp_path / "r.json").read_text()) == json.loads(capsys.readouterr().out)


def test_the_backend_is_read_once_jax_has_started():
  import jax
  jax.devices()
  assert harness.machine()["backend"] == jax.default_backend()


# ---- Quick mode and fake devices ----


def test_quick_sets_defaults_and_flags_given_win():
  def bench():
    b = harness.Bench(None, quick=dict(steps=6, methods=["noloco"]))
    b.add_argument("--steps", type=int, default=18)
    b.add_argument("--methods", nargs="+", default=["noloco", "diloco"])
    return b
  assert (bench().parse([]).steps, bench().parse([]).quick) == (18, False)
  args = bench().parse(["--quick"])
  assert (args.steps, args.methods) == (6, ["noloco"])
  args = bench().parse(["--quick", "--steps=2"])
  assert (args.steps, args.methods) == (2, ["noloco"])
  assert "--quick" not in harness.Bench(None).parser.format_help()


def test_cpu_devices_are_set_before_jax_starts_and_a_value_already_set_wins(monkeypatch):
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  bench = harness.Bench(None, cpu_devices=lambda args: args.replicas, cpu_only=True)
  bench.add_argument("--replicas", type=int, default=4)
  bench.parse(["--replicas=6"])
  assert (os.environ["JAX_NUM_CPU_DEVICES"], os.environ["JAX_PLATFORMS"]) == ("6", "cpu")
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
  bench.parse(["--replicas=2"])
  assert os.environ["JAX_NUM_CPU_DEVICES"] == "8"


# ---- Every script: on the harness, and its --help as a file and as a module ----

SCRIPTS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(REPO, "experiments", "*.py"))
                 if not p.endswith("__init__.py"))


def test_every_script_is_on_the_harness_and_the_lab_stays_small():
  """Each script builds its command line with harness.Bench and runs as `harness.run(main)` (no
  hand-rolled argparse, no JSON tail of its own); at most 15 of them (experiments/RESULTS.md keeps the
  figures of the one-offs that were removed, with the commit that produced them)."""
  assert len(SCRIPTS) <= 15, SCRIPTS
  for script in SCRIPTS:
    with open(os.path.join(REPO, "experiments", f"{script}.py"), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    names = {getattr(c.func, "attr", getattr(c.func, "id", None)) for c in calls}
    assert "Bench" in names and "ArgumentParser" not in names, script
    last = tree.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.body[0]) == "harness.run(main)", script


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_as_a_file_and_as_a_module(script):
  # --help parses flags and exits before any JAX work; the imports alone take a few seconds on a loaded
  # machine (2 cores, load ~10: up to ~6 s a run measured), hence ten times that as the limit.
  for cmd in ([sys.executable, os.path.join("experiments", f"{script}.py"), "--help"],
              [sys.executable, "-m", f"experiments.{script}", "--help"]):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, (cmd, done.stderr[-2000:])
    assert done.stdout.startswith("usage:"), (cmd, done.stdout[:500])
    assert "--json" in done.stdout, (cmd, done.stdout)
