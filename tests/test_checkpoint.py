"""Checkpoints: exact resume after SIGKILL and SIGTERM, corrupt-checkpoint fallback, the NaN policies,
restoring onto fewer devices, warm start.

Every run is the smoke config (8 replicas of a tiny Llama on 8 fake CPU devices) for STEPS steps.
Compilation dominates the cost, so the module shares one persistent compilation cache (in-process and
with its subprocesses) and one uninterrupted reference run that the resumed runs must reproduce; the
round_robin pairing keeps one outer program for all twelve rounds (fresh compiles one per round). Where a test needs only what a
restore returns, it restores onto an abstract state (no compilation) and stops there: the exactness
of training on from a restore is checked once, by the SIGKILL test.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import default
from noloco_jax.io import checkpoint
from noloco_jax.io.checkpoint import logs
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.outer import wire
from noloco_jax import training
from noloco_jax.training import build as build_lib
from noloco_jax.training import run as run_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 36  # H = 3, logs every 3 steps, evaluates every 6: twelve rounds
FLAGS = [f"--config.num_steps={STEPS}", "--config.checkpoint_every=2", "--config.outer.pairing=round_robin"]
START_TIMEOUT_S = 600  # a cold start compiles everything: 2.5 min for the smoke run at load 30 on 2 cores


def smoke(**fields):
  config = default.get_config("smoke")
  config.num_steps, config.checkpoint_every, config.outer.pairing = STEPS, 2, "round_robin"
  for dotted, value in fields.items():
    *parents, leaf = dotted.split("__")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def rows(workdir) -> list[dict]:
  """metrics.jsonl without timing metrics (the only ones allowed to differ between runs)."""
  return [{k: v for k, v in r.items() if not k.startswith("perf/")}
          for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def restore_only(workdir, **fields):
  """(setup, state, loop state) as a run on `workdir` would start; compiles nothing, reads no data."""
  setup = build_lib.build(smoke(**fields))
  state, loop = checkpoint.Checkpointer(run_lib.checkpoint_info(setup), workdir).restore(
      jax.eval_shape(setup.init_state), _AnyData(), training.LoopState())
  return setup, state, loop


class _AnyData:
  """Stands in for the data iterator: checks that the checkpoint positions every replica."""

  def set_state(self, state):
    assert set(state["replicas"]) == {str(r) for r in range(8)}


def checkpoint_steps(workdir) -> list[int]:
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def wait_for_background_saves(workdir, timeout_s: float = 60) -> None:
  root, deadline = os.path.join(workdir, "checkpoints"), time.time() + timeout_s
  while [n for n in os.listdir(root) if "tmp" in n] and time.time() < deadline:
    time.sleep(0.05)


def copy_run(src, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One persistent compilation cache for this module's runs, in-process and in subprocesses."""
  path = str(tmp_path_factory.mktemp("jax_cache"))
  options = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0,
             "jax_persistent_cache_min_entry_size_bytes": -1}
  saved = {k: getattr(jax.config, k) for k in options}
  for k, v in options.items():
    jax.config.update(k, v)
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
             **{k.upper(): str(v) for k, v in options.items()})
  yield env
  for k, v in saved.items():
    jax.config.update(k, v)


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory):
  """The uninterrupted run: its workdir and final state."""
  del cache
  workdir = str(tmp_path_factory.mktemp("reference"))
  result = training.train_and_evaluate(smoke(), workdir)
  return workdir, result["state"]


def launch(workdir, env, *flags) -> tuple[subprocess.Popen, str]:
  log = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke", f"--workdir={workdir}",
         *FLAGS, *flags], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
  return proc, log


def wait_for_train_row(workdir, proc, log, min_step: int) -> int:
  """Polls metrics.jsonl until a train/loss row with step ≥ min_step appears; returns that step."""
  path, deadline = os.path.join(workdir, "metrics.jsonl"), time.time() + START_TIMEOUT_S
  while time.time() < deadline:
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            row = json.loads(line)
          except json.JSONDecodeError:
            continue  # a line being written
          if "train/loss" in row and row["step"] >= min_step:
            return row["step"]
    if proc.poll() is not None:
      pytest.fail(f"the run ended (exit {proc.returncode}) before step {min_step}:\n{open(log).read()[-3000:]}")
    time.sleep(0.02)
  proc.kill()
  pytest.fail(f"no train row with step ≥ {min_step} within {START_TIMEOUT_S} s:\n{open(log).read()[-3000:]}")


@pytest.fixture(scope="module")
def killed(cache, tmp_path_factory):
  """A run of `python -m noloco_jax.main` killed with SIGKILL mid-run: a pristine copy of its workdir."""
  workdir = str(tmp_path_factory.mktemp("killed") / "run")
  proc, log = launch(workdir, cache)
  step = wait_for_train_row(workdir, proc, log, min_step=9)
  assert proc.poll() is None, "the run finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert checkpoint_steps(workdir), f"no checkpoint finished before the kill at step ≥ {step}"
  return copy_run(workdir, tmp_path_factory.mktemp("killed_copy") / "run")


# ---------------------------------------------------------------------------------------------------
# Exact resume.
# ---------------------------------------------------------------------------------------------------


def test_sigkill_then_restart_reproduces_the_uninterrupted_metrics(reference, killed, tmp_path, caplog):
  workdir = copy_run(killed, tmp_path / "run")
  restored = checkpoint_steps(workdir)[-1]
  killed_rows = rows(workdir)
  with caplog.at_level("INFO"):
    training.train_and_evaluate(smoke(), workdir)  # the restart (in-process: the same code as main)
  assert f"resumed from step {restored}" in caplog.text
  late = [r for r in killed_rows if r["step"] > restored]
  if late:  # rows the killed run wrote after its last checkpoint: dropped, never silently
    assert f"dropped {len(late)} row(s)" in caplog.text
  assert rows(workdir) == rows(reference[0])  # bitwise: every loss, eval and comm figure
  # Every round's pairing exactly once (issue 18: rows buffered at the kill were lost for good).
  assert pairing_rows(workdir) == pairing_rows(reference[0])
  assert [p["round"] for p in pairing_rows(workdir)] == list(range(STEPS // 3))


def test_sigterm_saves_the_step_reached_and_exits_0(reference, cache, tmp_path):
  workdir = str(tmp_path / "run")
  proc, log = launch(workdir, cache, "--config.checkpoint_every=0")  # no save but the preemption one
  wait_for_train_row(workdir, proc, log, min_step=3)
  proc.send_signal(signal.SIGSTOP)  # freeze it, so that the signal lands mid-run however fast it is
  reached = max(r["step"] for r in rows(workdir))
  proc.send_signal(signal.SIGTERM)
  proc.send_signal(signal.SIGCONT)
  assert proc.wait(timeout=START_TIMEOUT_S) == 0, open(log).read()[-3000:]
  assert "Stop requested: saved a checkpoint at step" in open(log).read()

  (saved,) = checkpoint_steps(workdir)
  assert reached <= saved < STEPS  # the step it was in (plus at most the one the signal interrupted)
  assert max(r["step"] for r in rows(workdir)) <= saved
  with open(os.path.join(workdir, "checkpoints", str(saved), "meta", "metadata")) as f:
    meta = json.load(f)
  assert meta["step"] == saved and meta["round"] == saved // 3
  assert meta["pairing"]["mode"] == "round_robin" and meta["pairing"]["round"] == saved // 3

  _, _, resume = restore_only(workdir, checkpoint_every=0)
  assert resume.step == saved and resume.pending_steps == list(range(saved // 3 * 3 + 1, saved + 1))
  assert resume.round == saved // 3 and len(resume.pending_metrics) == len(resume.pending_steps)


# ---------------------------------------------------------------------------------------------------
# Failures: a corrupt checkpoint, a different setup, NaN.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax, after a failed read
def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(killed, tmp_path, caplog):
  workdir = copy_run(killed, tmp_path / "run")
  root = os.path.join(workdir, "checkpoints")
  steps = checkpoint_steps(workdir)
  assert len(steps) >= 2, steps
  latest, previous = steps[-1], steps[-2]
  data = os.path.join(root, str(latest), "state", "d")  # the merged array data that restore reads
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)
  # And a write interrupted before orbax's rename: never a candidate, cleaned up at start.
  os.makedirs(os.path.join(root, f"{latest + 2}.orbax-checkpoint-tmp", "state"))

  with caplog.at_level("INFO"):
    _, _, resume = restore_only(workdir)
  assert f"step {latest} in {root} is not readable" in caplog.text
  assert resume.step == previous and f"resumed from step {previous}" in caplog.text
  assert [n.split("-")[0] for n in os.listdir(os.path.join(workdir, "checkpoints_corrupt"))] == [str(latest)]
  assert checkpoint_steps(workdir) == steps[:-1]  # the older good ones untouched; `latest` may be saved again
  assert not [n for n in os.listdir(root) if "tmp" in n]


def test_a_checkpoint_of_another_setup_is_an_error_not_a_fallback(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "run")
  before = checkpoint_steps(workdir)
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="another shape"):
    restore_only(workdir, model__d_model=64)
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="another pairing schedule"):
    restore_only(workdir, outer__pairing="fresh")
  assert checkpoint_steps(workdir) == before  # nothing moved aside


def poisoned(real_build, call: int, replica: int, weights: bool = True):
  """build_lib.build whose inner step's `call`-th call returns NaN for `replica`: its loss (and weights)."""

  def build(config, *args, **kwargs):
    setup = real_build(config, *args, **kwargs)
    real_step, calls = setup.inner_step, [0]

    def inner_step(state, batch):
      state, metrics = real_step(state, batch)
      calls[0] += 1
      if calls[0] == call:
        nan_at = lambda x: jax.device_put(x.at[replica].set(np.nan), x.sharding)
        metrics = {**metrics, "loss": nan_at(metrics["loss"])}
        if weights:
          state = state.replace(params=jax.tree.map(nan_at, state.params))
      return state, metrics

    setup.inner_step = inner_step
    return setup

  return build


def poison_step(monkeypatch, call: int, replica: int) -> None:
  """Makes the `call`-th inner step return NaN for `replica`: its loss and its weights."""
  monkeypatch.setattr(build_lib, "build", poisoned(build_lib.build, call, replica))


def test_nan_stops_the_run_before_saving_naming_step_and_replica(cache, monkeypatch, tmp_path):
  del cache
  poison_step(monkeypatch, call=5, replica=3)
  workdir = str(tmp_path / "run")
  # Checkpoints every step, logs every 3: the check before the save of step 5 is the one that fires.
  with pytest.raises(FloatingPointError, match=r"at step 5 on replica 3"):
    training.train_and_evaluate(smoke(checkpoint_every=1), workdir)
  wait_for_background_saves(workdir)  # (main's exit would wait for them too)
  assert checkpoint_steps(workdir)[-1] == 4  # the last good one, complete and untouched
  monkeypatch.undo()
  _, state, resume = restore_only(workdir)
  assert resume.step == 4 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_skip_round_undoes_the_round_and_goes_on(cache, monkeypatch, tmp_path, caplog):
  del cache
  poison_step(monkeypatch, call=5, replica=3)  # step 5: inside the round of steps 4-6
  with caplog.at_level("WARNING"):
    result = training.train_and_evaluate(smoke(nan_policy="skip_round", checkpoint_every=6), str(tmp_path))
  assert result["history"]["skipped_rounds"] == [[4, 6]]
  assert "undoing the round of steps 4-6 (loss nan at step 5 on replica 3)" in caplog.text
  state = result["state"]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  # The three undone steps are not counted by the replicas (their learning-rate schedule included).
  np.testing.assert_array_equal(np.asarray(state.step), STEPS - 3)
  logged = {r["step"]: r for r in rows(str(tmp_path)) if "train/loss" in r}
  assert logged[6]["train/loss"] == "nan" and np.isfinite(logged[9]["train/loss"])
  # Reported, not only in history (issue 18): the train rows' running count and the summary.
  assert [logged[s]["outer/skipped_rounds"] for s in (3, 6, 9)] == [0, 1, 1]
  assert "skipped rounds  1 (nan_policy=skip_round): steps 4-6" in result["text"]


# ---------------------------------------------------------------------------------------------------
# Another layout; warm start.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.exhaustive(reason="training on after a restore onto fewer devices (the restore: "
                        "test_restore_onto_two_devices_is_bitwise; several replicas per device: tests/test_train.py's "
                        "simulator test)")
def test_restore_onto_fewer_devices_continues_the_same_run(reference, killed, tmp_path):
  """8 replicas saved from 8 devices, trained on from 4 devices holding 2 replicas each.

  The numbers agree to float32 round-off (rtol 1e-5): the per-replica math is the same, but XLA may
  fuse a program holding k replicas per device differently.
  """
  workdir = copy_run(killed, tmp_path / "run")
  training.train_and_evaluate(smoke(num_devices=4), workdir)
  got, want = rows(workdir), rows(reference[0])
  assert [sorted(r) for r in got] == [sorted(r) for r in want]
  for g, w in zip(got, want):
    for key, value in w.items():
      np.testing.assert_allclose(g[key], value, rtol=1e-5, atol=1e-7, err_msg=f"{key} at step {w['step']}")


def test_restore_onto_two_devices_is_bitwise(reference, tmp_path):
  """The final checkpoint of the reference run, restored onto 2 devices (4 replicas each)."""
  ref_dir, ref_state = reference
  setup, state, resume = restore_only(copy_run(ref_dir, tmp_path / "run"), num_devices=2)
  assert resume.step == STEPS and setup.mesh.devices.size == 2
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    assert got.sharding == mesh_lib.replica_sharding(setup.mesh)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_warm_start_takes_the_weights_and_starts_fresh(reference, tmp_path):
  ref_dir, ref_state = reference
  setup = build_lib.build(smoke(checkpoint__warm_start=ref_dir))
  fresh = training.LoopState()
  state, loop = checkpoint.Checkpointer(run_lib.checkpoint_info(setup), str(tmp_path)).restore(
      setup.init_state(), None, fresh)
  assert loop is fresh and not loop.resumed
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got, want in zip(jax.tree.leaves(state.outer["slow"]), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(state.outer["momentum"]))
  assert not np.asarray(state.step).any()


# ---------------------------------------------------------------------------------------------------
# Helpers, without training.
# ---------------------------------------------------------------------------------------------------


def test_the_loop_state_round_trips_whole_through_json():
  """What Checkpointer.save writes of the loop state is what restore hands back (to_record / from_record)."""
  rng = np.random.default_rng(1)
  loop = training.LoopState(step=7, round=2, comm_bytes=12345, bytes_sent=0.5, bytes_received=0.25,
                            history={"eval": [{"step": 0, "eval/loss": 5.5}]})
  loop.add_step(8, {"loss": rng.normal(size=4).astype(np.float32), "grad_norm": rng.random(4, np.float32)},
                wire.allreduce(10, 3))
  loop.add_round(8, {"pseudo_grad_norm": rng.random(4, np.float32)}, wire.permute(100))
  loop.set_round_weight_std(np.float32(0.25))
  back = training.LoopState.from_record(json.loads(json.dumps(loop.to_record())))
  assert (back.step, back.round, back.comm_bytes, back.history) == (8, 3, 12455, loop.history)
  # On the wire: a ring all-reduce of 10 bytes over 3 replicas sends 2·2/3·10 per replica, a permute 100.
  assert (back.bytes_sent, back.bytes_received) == (loop.bytes_sent, loop.bytes_received)  # exact through JSON
  assert (back.bytes_sent, back.bytes_received) == pytest.approx((0.5 + 40 / 3 + 100, 0.25 + 40 / 3 + 100), rel=1e-15)
  assert back.pending_steps == [8]
  for a, b in zip(jax.tree.leaves((loop.pending_metrics, loop.pending_rounds)),
                  jax.tree.leaves((back.pending_metrics, back.pending_rounds))):
    assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_unlogged_metrics_round_trip_bitwise_through_json():
  rng = np.random.default_rng(0)
  metrics = [{"loss": rng.normal(size=8).astype(np.float32) * 1e3, "grad_norm": rng.random(8, np.float32)}
             for _ in range(2)]
  rounds = [({"pseudo_grad_norm": rng.random(8, np.float32)}, np.float32(rng.random()))]
  record = json.loads(json.dumps(checkpoint.pending_to_host([4, 5], metrics, rounds)))
  steps, metrics2, rounds2 = checkpoint.pending_from_host(record)
  assert steps == [4, 5]
  for a, b in zip(jax.tree.leaves((metrics, rounds)), jax.tree.leaves((metrics2, rounds2))):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_rewrite_for_resume_keeps_earlier_rows_and_counts_a_cut_line(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 0, "a": 1}\n{"step": 3, "a": 2}\n{"step": 6, "a": 3}\n{"step": 9, "a"')
  assert logs.rewrite_for_resume(path, 3) == logs.Rewrite(late=1, cut=True)
  assert [r["step"] for r in metrics_lib.read_jsonl(path)] == [0, 3]
  assert logs.rewrite_for_resume(path, 3) == logs.Rewrite()


# ---------------------------------------------------------------------------------------------------
# Reliability (issue 18): each test reproduces a failure seen by hand before its fix.
# ---------------------------------------------------------------------------------------------------


def pairing_rows(workdir) -> list[dict]:
  path = os.path.join(workdir, "pairings.jsonl")
  return metrics_lib.read_jsonl(path) if os.path.exists(path) else []


def test_every_log_row_is_on_disk_before_the_checkpoint_that_covers_it(killed):
  """kill -9 mid-run: every row of every log up to the last complete checkpoint survives."""
  latest = checkpoint_steps(killed)[-1]
  assert [p["round"] for p in pairing_rows(killed) if p["step"] <= latest] == list(range(latest // 3))
  metric_rows = rows(killed)
  assert [r["step"] for r in metric_rows if "train/loss" in r and r["step"] <= latest] == list(range(3, latest + 1, 3))
  assert [r["step"] for r in metric_rows if "eval/loss" in r and r["step"] <= latest] == list(range(0, latest + 1, 6))


def workdir_contents(workdir) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(workdir):
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.relpath(os.path.join(root, name), workdir)] = f.read()
  return out


def test_a_refused_resume_changes_nothing_in_the_workdir(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "run")
  before = workdir_contents(workdir)
  with pytest.raises(checkpoint.IncompatibleCheckpointError):
    training.train_and_evaluate(smoke(model__d_model=64), workdir)
  after = workdir_contents(workdir)
  assert sorted(after) == sorted(before)
  assert [name for name in before if after[name] != before[name]] == []  # config.json included


def test_a_refused_resume_names_the_config_fields_that_differ(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "run")
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"inner\.grad_clip: 1\.0 -> 0\.0"):
    restore_only(workdir, inner__grad_clip=0.0)
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"model\.d_model: 32 -> 64"):
    restore_only(workdir, model__d_model=64)


def test_resuming_with_another_outer_kind_is_an_error_naming_it(reference, tmp_path):
  workdir = copy_run(reference[0], tmp_path / "run")  # noloco; gossip's state has the same shapes
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"outer\.kind: 'noloco' -> 'gossip'"):
    restore_only(workdir, outer__kind="gossip")
  assert checkpoint_steps(workdir) == checkpoint_steps(reference[0])  # an error, not a fallback


def test_a_run_killed_before_its_first_checkpoint_starts_its_logs_afresh(reference, killed, tmp_path, caplog):
  workdir = copy_run(killed, tmp_path / "run")
  shutil.rmtree(os.path.join(workdir, "checkpoints"))  # as if killed before the first save completed
  held = len(rows(workdir))
  assert held
  with caplog.at_level("WARNING"):
    training.train_and_evaluate(smoke(), workdir)
  assert f"held {held} row(s) of an earlier run" in caplog.text
  assert rows(workdir) == rows(reference[0])  # every step once, as in the uninterrupted run
  assert pairing_rows(workdir) == pairing_rows(reference[0])


def test_a_silently_corrupted_state_file_is_detected_and_set_aside(reference, tmp_path, caplog):
  """8 bytes overwritten inside the latest step's state data: restored without complaint before."""
  workdir = copy_run(reference[0], tmp_path / "run")
  steps = checkpoint_steps(workdir)
  latest, previous = steps[-1], steps[-2]
  data = os.path.join(workdir, "checkpoints", str(latest), "state", "ocdbt.process_0", "d")
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.seek(os.path.getsize(biggest) // 2)
    original = f.read(8)
    f.seek(os.path.getsize(biggest) // 2)
    f.write(bytes(255 - b for b in original))
  with caplog.at_level("INFO"):
    _, _, resume = restore_only(workdir)
  assert f"step {latest} in {os.path.join(workdir, 'checkpoints')} is not readable" in caplog.text
  assert resume.step == previous
  assert [n.split("-")[0] for n in os.listdir(os.path.join(workdir, "checkpoints_corrupt"))] == [str(latest)]


class _KilledHere(BaseException):
  """Stands for a SIGKILL at this point: nothing after it runs, and the files are as the kill left them."""


def _truncate_state(workdir, step) -> None:
  data = os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0", "d")
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)


def test_a_kill_between_two_quarantine_moves_loses_nothing(reference, tmp_path, monkeypatch):
  """Issue 33's probe: the two latest steps unreadable, the run killed after moving the first aside. The next
  run finds the second unreadable again, moves it too, and resumes from the same step; nothing readable is
  moved. (Each move is one rename within the workdir: a kill cannot leave half a step.)"""
  from noloco_jax.io.checkpoint import quarantine  # pylint: disable=g-import-not-at-top
  workdir = copy_run(reference[0], tmp_path / "run")
  *_, good, second, latest = checkpoint_steps(workdir)
  for step in (latest, second):
    _truncate_state(workdir, step)
  real_move, moved = shutil.move, []

  def move(src, dst):
    if moved:
      raise _KilledHere()
    moved.append(real_move(src, dst))

  monkeypatch.setattr(quarantine.shutil, "move", move)
  with pytest.raises(_KilledHere):
    restore_only(workdir)
  assert checkpoint_steps(workdir)[-2:] == [good, second]
  monkeypatch.setattr(quarantine.shutil, "move", real_move)
  _, _, resume = restore_only(workdir)
  assert resume.step == good and checkpoint_steps(workdir)[-1] == good
  assert sorted(int(n.split("-")[0]) for n in os.listdir(os.path.join(workdir, checkpoint.CORRUPT_DIR))) == [second, latest]


def stderr_of(log: str) -> list[str]:
  with open(log) as f:
    return [line.rstrip("\n") for line in f if line.strip()]


def test_falling_back_from_a_corrupt_checkpoint_prints_no_tracebacks(killed, cache, tmp_path):
  """It printed one `Event loop is closed` traceback per pending read (~29,500 lines for a large model)."""
  workdir = copy_run(killed, tmp_path / "run")
  data = os.path.join(workdir, "checkpoints", str(checkpoint_steps(workdir)[-1]), "state", "d")
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 2)
  proc, log = launch(workdir, cache)
  assert proc.wait(timeout=START_TIMEOUT_S) == 0, open(log).read()[-3000:]
  lines = stderr_of(log)
  assert "is not readable" in "\n".join(lines)
  assert not [l for l in lines if "Traceback" in l or "Event loop is closed" in l], "\n".join(lines[-40:])
  assert len(lines) < 150, len(lines)


# ---------------------------------------------------------------------------------------------------
# Issue 25: everything a resume reads is verified; a damaged step is set aside, never trained on.
# ---------------------------------------------------------------------------------------------------


def _edit_json(path, edit) -> None:
  with open(path) as f:
    item = json.load(f)
  edit(item)
  with open(path, "w") as f:
    json.dump(item, f)


def _set(keys, value):
  def edit(item):
    for key in keys[:-1]:
      item = item[key]
    item[keys[-1]] = value(item[keys[-1]])
  return edit


@pytest.mark.parametrize("item,edit", [
    ("data/process_0.json", _set(["iterator", "replicas", "3", "next_index"], lambda i: i + 5)),
    ("meta/metadata", _set(["comm_bytes"], lambda b: b + 1000)),
    ("meta/metadata", _set(["history", "eval", 0, "eval/loss"], lambda x: x / 2)),
    ("data/process_0.json", "previous step's file"),
], ids=["next_index", "comm_bytes", "history", "data_of_another_step"])
def test_an_edited_json_item_sets_the_step_aside(reference, tmp_path, caplog, item, edit):
  """Issue 25 item 2: an edited next_index or comm_bytes resumed silently (another final loss; every later
  comm/bytes_per_replica shifted). Now the step is set aside like a corrupt one and the previous one used."""
  workdir = copy_run(reference[0], tmp_path / "run")
  latest, previous = checkpoint_steps(workdir)[-2:][::-1]
  path = os.path.join(workdir, "checkpoints", str(latest), item)
  if edit == "previous step's file":
    shutil.copy(os.path.join(workdir, "checkpoints", str(previous), item), path)
  else:
    _edit_json(path, edit)
  with caplog.at_level("INFO"):
    _, _, resume = restore_only(workdir)
  assert f"step {latest} in {os.path.join(workdir, 'checkpoints')} is not readable (ItemChecksumError" in caplog.text
  assert resume.step == previous
  assert [n.split("-")[0] for n in os.listdir(os.path.join(workdir, "checkpoints_corrupt"))] == [str(latest)]


def _rewrite_digest(meta):
  from noloco_jax.io.checkpoint import checksum  # pylint: disable=g-import-not-at-top
  meta["digest"] = checksum.digest(meta)


@pytest.mark.parametrize("field,value", [("groups", [[0, 2], [1, 3], [4, 6], [5, 7]]), ("seed", 5)])
def test_a_pairing_record_that_contradicts_its_config_falls_back(reference, tmp_path, caplog, field, value):
  """Issue 25 item 3: a meta record whose pairing disagrees with its own (unchanged) config ended the run
  ("saved under another pairing schedule; no config field differs. Resume with ..."): wrong advice, and no
  fallback. The record's groups, or one of its parameters (seed: what the merged tree still refused), are
  changed and the digest rewritten, so that only the pairing check can see it."""
  workdir = copy_run(reference[0], tmp_path / "run")
  latest, previous = checkpoint_steps(workdir)[-2:][::-1]

  def damage(meta):
    meta["pairing"][field] = value
    _rewrite_digest(meta)

  _edit_json(os.path.join(workdir, "checkpoints", str(latest), "meta", "metadata"), damage)
  with caplog.at_level("INFO"):
    _, _, resume = restore_only(workdir)
  assert "its pairing record disagrees with the schedule of its own config" in caplog.text
  assert resume.step == previous
  # Another schedule by config is still an error naming the field, not a fallback.
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"outer\.pairing: 'round_robin' -> 'fresh'"):
    restore_only(workdir, outer__pairing="fresh")
  assert checkpoint_steps(workdir)[-1] == previous


def test_a_damaged_log_does_not_block_a_resume_and_is_repaired(reference, tmp_path, caplog):
  """Issue 25 item 5: a line `42` in metrics.jsonl blocked every resume (AttributeError, no file or line
  named); an emptied metrics.jsonl or a truncated pairings.jsonl went unreported (the step-0 row of
  model/num_params, too, on the merged tree)."""
  workdir = copy_run(reference[0], tmp_path / "run")
  latest = checkpoint_steps(workdir)[-1]
  metrics_path, pairings_path = os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "pairings.jsonl")
  with open(metrics_path) as f:
    lines = f.readlines()
  evals = [line for line in lines if '"eval/loss"' in line or '"model/num_params"' in line]
  assert len(evals) == len([r for r in rows(reference[0]) if "eval/loss" in r]) + 1
  with open(metrics_path, "w") as f:  # every eval row and the step-0 row gone, a damaged line in their place
    f.writelines([line for line in lines if line not in evals] + ["42\n"])
  with open(pairings_path) as f:
    pairings = f.readlines()
  with open(pairings_path, "w") as f:
    f.writelines(pairings[:2])
  with caplog.at_level("WARNING"):
    _, _, resume = restore_only(workdir)
  assert resume.step == latest
  assert f"{metrics_path} line {len(lines) - len(evals) + 1} is damaged" in caplog.text
  assert f"{metrics_path} lacked its first row (step 0, model/num_params)" in caplog.text
  assert rows(workdir) == [r for r in rows(reference[0]) if r["step"] <= latest]  # the eval rows are back
  assert pairing_rows(workdir) == [p for p in pairing_rows(reference[0]) if p["step"] <= latest]


def test_a_rotated_out_step_leaves_by_one_rename_and_its_files_are_purged(cache, tmp_path, monkeypatch):
  """checkpoint.keep's rotation: orbax's own deletion removes a step's files one by one in place, so a
  process killed meanwhile left a half-deleted step that every reader still listed as committed
  (bench_churn, a SIGKILL at mtbf 30 s). Every removal must be one rename into checkpoints/deleting/
  (atomic: the step is listed whole or not at all), emptied once the next save is complete and at the end."""
  del cache
  from orbax.checkpoint._src.path import deleter  # pylint: disable=g-import-not-at-top
  removals, original = [], deleter.PathDeleter.delete

  def recording(self, path, *, destination=None, overwrite=False):
    removals.append((os.path.basename(str(path)), destination is not None))
    return original(self, path, destination=destination, overwrite=overwrite)

  monkeypatch.setattr(deleter.PathDeleter, "delete", recording)
  workdir = str(tmp_path / "run")
  training.train_and_evaluate(smoke(num_steps=8, checkpoint__keep=2, eval_every=0), workdir)
  assert [name for name, _ in removals] == ["2", "4"], removals  # steps 2, 4, 6, 8 saved, the last 2 kept
  assert all(renamed for _, renamed in removals), removals  # never removed in place
  assert checkpoint_steps(workdir) == [6, 8]
  assert os.listdir(os.path.join(workdir, "checkpoints", "deleting")) == []
  from noloco_jax.io.checkpoint import read  # pylint: disable=g-import-not-at-top
  assert read.steps(workdir) == [6, 8]
