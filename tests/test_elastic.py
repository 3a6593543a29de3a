"""Elastic resume (config.checkpoint.elastic, io/checkpoint/resize.py): NumPy references of the resize
plans, then a real lost host: a 2-process job whose process 1 is killed at step 8 (NOLOCO_FAULTS),
resumed as it was (the same 8 replicas, one process), by the survivor (1 process, its 4 devices)
dropping process 1's replicas or re-creating them from their last partners, or by the survivor and a
replacement host (2 processes) growing to 12 replicas; each continues to the end and logs the change.

The killed job runs once per module (about 30 s); each resume copies its workdir.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax import training
from noloco_jax.inner.state import TrainState
from noloco_jax.io import checkpoint
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.io.checkpoint import checksum
from noloco_jax.io.checkpoint import logs
from noloco_jax.io.checkpoint import resize
from noloco_jax.outer import epidemic
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.parallel import permutations
from noloco_jax.runtime import launch_local
from noloco_jax.training import build as build_lib
from noloco_jax.training import run as run_lib
from noloco_jax.training.loop_state import LoopState

import mp_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- The plans against NumPy ----


def host_state(n: int, seed: int = 0) -> TrainState:
  """A NumPy state of n replicas whose every leaf row is distinct (row r holds values r + noise)."""
  rng = np.random.default_rng(seed)
  leaf = lambda *shape: (np.arange(n).reshape((n,) + (1,) * len(shape)) + rng.random((n,) + shape)).astype(np.float32)
  params = {"w": leaf(3, 2), "b": leaf(2)}
  return TrainState(step=np.full((n,), 6, np.int32), params=params,
                    opt_state={"count": np.full((n,), 6, np.int32), "mu": {"w": leaf(3, 2), "b": leaf(2)},
                               "nu": {"w": leaf(3, 2), "b": leaf(2)}},
                    outer={"slow": {"w": leaf(3, 2), "b": leaf(2)}, "momentum": {"w": leaf(3, 2), "b": leaf(2)}})


def rows_of(state: TrainState, rows) -> TrainState:
  return jax.tree.map(lambda x: x[np.asarray(rows)], state)


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_drop_keeps_the_other_replicas_in_order():
  old = host_state(8)
  plan = resize.plan_drop(8, [5, 1])
  assert plan.source == (0, 2, 3, 4, 6, 7) and plan.dropped == (1, 5) and plan.new_n == 6
  assert_trees_equal(resize.resize_state(old, plan), rows_of(old, [0, 2, 3, 4, 6, 7]))


def test_recreate_copies_the_whole_state_of_the_last_surviving_partner():
  # Round 2 pairs 5 with 1 (a survivor); 6 with 7 (both lost) so 6 and 7 go back to round 1, where
  # 6 met 0 and 7 met 6 (lost): 7 goes back to round 0 (7 with 3). 4 never met a survivor: a seeded draw.
  rounds_latest_first = [((5, 1), (6, 7), (4, 0)), ((6, 0), (7, 6)), ((7, 3), (4, 5))]
  lost, survivors = [4, 5, 6, 7], [0, 1, 2, 3]
  draws = {}

  def rng_for(r):
    draws[r] = True
    return np.random.default_rng([9, r])

  partners = resize.last_partners(rounds_latest_first, lost, survivors, rng_for)
  assert partners[5] == 1 and partners[6] == 0 and partners[7] == 3
  assert partners[4] == 0  # (4, 0) in the latest round: 0 survives
  assert list(draws) == []
  partners = resize.last_partners(rounds_latest_first[1:], lost, survivors, rng_for)
  assert partners[4] == int(np.array(survivors)[np.random.default_rng([9, 4]).integers(4)]) and list(draws) == [4, 5]
  old = host_state(8)
  plan = resize.plan_recreate(8, {4: 2, 5: 1, 6: 0, 7: 3})
  assert plan.source == (0, 1, 2, 3, 2, 1, 0, 3)
  assert_trees_equal(resize.resize_state(old, plan), rows_of(old, [0, 1, 2, 3, 2, 1, 0, 3]))


def reference_last_partner(schedule, rounds_done: int, r: int, lost: set[int]):
  """An independent reference: the latest round whose group holds r and a survivor, its first survivor."""
  for t in reversed(range(rounds_done)):
    group = next(g for g in schedule.groups(t) if r in g)
    alive = [m for m in group if m not in lost]
    if alive:
      return alive[0]
  return None


@pytest.mark.parametrize("mode,group_size", [("fresh", 2), ("fresh", 4), ("round_robin", 2), ("fixed", 2)])
def test_recreate_partners_follow_the_seeded_schedule(mode, group_size):
  schedule = pairing.PairingSchedule(seed=3, num_replicas=8, group_size=group_size, mode=mode)
  lost = [1, 4, 6]
  plan = resize.make_plan(mode="recreate", elastic_replicas="1,4,6", old_n=8, new_n=8, held={}, process_count=1,
                          seed=3, step=30, rounds_done=10, schedule=schedule)
  for r in lost:
    expected = reference_last_partner(schedule, 10, r, set(lost))
    if expected is not None:
      assert plan.recreated[r] == expected, (r, plan.recreated)
    else:  # `fixed` may pair two lost replicas every round: a seeded survivor, the same on a rerun
      assert plan.recreated[r] in (0, 2, 3, 5, 7)
  again = resize.make_plan(mode="recreate", elastic_replicas="1,4,6", old_n=8, new_n=8, held={}, process_count=1,
                           seed=3, step=30, rounds_done=10, schedule=schedule)
  assert again == plan


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
def test_recreate_under_epidemic_copies_a_replica_it_received_from(topology):
  """A lost replica becomes a copy of a survivor it received from in the latest round where it received
  from one (the senders read from the round's targets, not from its matchings), the first in the order
  of the round's matchings; a seeded survivor when no round did."""
  schedule = epidemic.EpidemicSchedule(seed=1, num_replicas=8, fanout=2, topology=topology)
  lost = (2, 5, 6)
  plan = resize.make_plan(mode="recreate", elastic_replicas="2,5,6", old_n=8, new_n=8, held={}, process_count=1,
                          seed=1, step=9, rounds_done=3, schedule=schedule)
  for r in lost:
    for t in (2, 1, 0):
      senders = {i for i, row in enumerate(schedule.targets(t)) if r in row and i not in lost}
      if senders:
        assert plan.recreated[r] in senders, (r, t, senders, plan.recreated)
        in_order = [int(m[r]) for m in schedule.groups(t) if m[r] >= 0 and m[r] not in lost]
        assert plan.recreated[r] == in_order[0]
        break
    else:
      assert plan.recreated[r] not in lost


def _noloco(**outer):
  """NoLoCo's method (outer/methods/noloco.py), whose new_replica rule grow applies."""
  config = default.get_config("smoke")
  config.outer.update(outer)
  return outer_lib.make(config.outer)


def test_grow_starts_new_replicas_from_a_peers_slow_weights():
  old = host_state(4)
  plan = resize.plan_grow(4, 7, seed=0, step=6)
  peers = [plan.added[i] for i in (4, 5, 6)]
  assert len(set(peers)) == 3 and plan.source == (0, 1, 2, 3, *peers)
  new = resize.resize_state(old, plan, _noloco().new_replica)  # the method makes its new replicas
  assert_trees_equal(rows_of(new, range(4)), old)  # the old replicas as they were
  for i, p in plan.added.items():
    one = rows_of(new, [i])
    assert_trees_equal(one.params, rows_of(old, [p]).outer["slow"])  # θ = φ of the peer
    assert_trees_equal(one.outer["slow"], rows_of(old, [p]).outer["slow"])  # φ = φ of the peer
    assert all(np.all(x == 0) for x in jax.tree.leaves(one.outer["momentum"]))  # δ = 0
    assert_trees_equal(one.opt_state, rows_of(old, [p]).opt_state)  # Adam moments and count: the peer's
    assert_trees_equal(one.step, rows_of(old, [p]).step)


def test_grow_inside_an_overlap_window_gives_new_replicas_a_merge_that_keeps_their_slow_weights():
  """With outer.overlap.steps, a new replica's in-flight mean is its own message γ·φ_p (θ = φ): the merge
  due later then leaves φ and δ = 0 as they are (NumPy: δ ← α·δ + mean − γ·φ, φ ← φ + δ)."""
  old = host_state(4)
  old = old.replace(outer={**old.outer, "inflight": jax.tree.map(lambda x: x + 100.0, old.outer["slow"])})
  plan = resize.plan_grow(4, 6, seed=0, step=6)
  alpha, gamma = 0.5, 0.7
  new = resize.resize_state(old, plan, _noloco(overlap=dict(steps=1), rule=dict(outer_momentum=alpha, consensus_weight=gamma)).new_replica)
  assert_trees_equal(rows_of(new, range(4)).outer["inflight"], old.outer["inflight"])  # old ones: as sent
  for i in plan.added:
    one = rows_of(new, [i]).outer
    for phi, delta, mean in zip(*(jax.tree.leaves(one[k]) for k in ("slow", "momentum", "inflight"))):
      new_delta = alpha * delta + mean - gamma * phi.astype(np.float64)
      np.testing.assert_allclose(new_delta, 0.0, atol=1e-6)
      np.testing.assert_allclose(phi + new_delta, phi, atol=1e-6)


def test_grow_peers_are_seeded_spread_and_uniform():
  assert resize.grow_peers(8, 12, seed=1, step=6) == resize.grow_peers(8, 12, seed=1, step=6)
  assert resize.grow_peers(8, 12, seed=1, step=6) != resize.grow_peers(8, 12, seed=2, step=6)
  peers = resize.grow_peers(3, 10, seed=0, step=0)  # 7 new replicas from 3 old: each serves before any repeats
  assert sorted(peers[:3]) == [0, 1, 2] and peers[3:6] == peers[:3] and peers[6] == peers[0]
  # The first new replica's peer is uniform over the old replicas (over seeds): a chi-square test.
  trials, n = 4000, 8
  counts = np.bincount([resize.grow_peers(n, n + 1, seed=s, step=3)[0] for s in range(trials)], minlength=n)
  chi2 = float(np.sum((counts - trials / n) ** 2 / (trials / n)))
  assert chi2 < 24.3, counts  # the 0.999 quantile of chi-square with 7 degrees of freedom


def test_pending_metrics_follow_the_row_map():
  steps, metrics, rounds = [7, 8], [{"loss": np.arange(8, dtype=np.float32) + s} for s in (7, 8)], \
      [({"pseudo_grad_norm": np.arange(8, dtype=np.float32) * 2}, np.float32(0.5))]
  record = {"step": 8, "round": 2, "comm_bytes": 10, "history": {"eval": []},
            "pending": checkpoint.pending_to_host(steps, metrics, rounds)}
  loop = LoopState.from_record(resize.resize_loop_record(record, resize.plan_drop(8, [1, 5, 6, 7])))
  np.testing.assert_array_equal(loop.pending_metrics[1]["loss"], np.float32([0, 2, 3, 4]) + 8)  # the kept ones'
  np.testing.assert_array_equal(loop.pending_rounds[0][0]["pseudo_grad_norm"], np.float32([0, 2, 3, 4]) * 2)
  assert loop.pending_rounds[0][1] == np.float32(0.5) and loop.step == 8 and loop.round == 2
  loop = LoopState.from_record(resize.resize_loop_record(record, resize.plan_recreate(8, {6: 0})))
  np.testing.assert_array_equal(loop.pending_metrics[1]["loss"], np.arange(8, dtype=np.float32) + 8)  # their own
  loop = LoopState.from_record(resize.resize_loop_record(record, resize.plan_grow(8, 11, seed=0, step=8)))
  losses = loop.pending_metrics[0]["loss"]
  assert losses.dtype == np.float32 and losses.shape == (11,)
  np.testing.assert_array_equal(losses[:8], np.arange(8, dtype=np.float32) + 7)
  np.testing.assert_allclose(losses[8:], np.mean(np.arange(8) + 7.0))
  np.testing.assert_allclose(losses.mean(), np.mean(np.arange(8) + 7.0), rtol=1e-7)  # the logged mean unchanged


def test_lost_replicas_are_named_or_those_of_the_missing_processes():
  held = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
  assert resize.lost_replicas("", held, process_count=1, old_n=8) == [4, 5, 6, 7]
  assert resize.lost_replicas("", held, process_count=2, old_n=8) == []
  assert resize.lost_replicas("6,2", held, process_count=2, old_n=8) == [2, 6]
  with pytest.raises(resize.ResizeError, match=r"elastic_replicas='2,9'.*\[9\] do not exist"):
    resize.lost_replicas("2,9", held, process_count=2, old_n=8)
  with pytest.raises(resize.ResizeError, match="so 2 must be dropped, but the lost replicas are"):
    resize.make_plan(mode="drop", elastic_replicas="", old_n=8, new_n=6, held=held, process_count=1, seed=0,
                     step=6, rounds_done=2, schedule=None)


def test_mode_for_refuses_a_changed_count_naming_the_flag():
  cfg = config_lib.validate(default.get_config("smoke"))
  meta = {"num_replicas": 8, "config": json.loads(cfg.to_json_best_effort())}
  assert resize.mode_for(meta, cfg.num_replicas, cfg.checkpoint) is None
  cfg.num_replicas = 4
  with pytest.raises(resize.ResizeError, match=r"holds 8 replicas and config.num_replicas=4: .*checkpoint.elastic=drop"):
    resize.mode_for(meta, cfg.num_replicas, cfg.checkpoint)
  cfg.checkpoint.elastic = "grow"
  with pytest.raises(resize.ResizeError, match=r"elastic='grow' does not resume 8 replicas"):
    resize.mode_for(meta, cfg.num_replicas, cfg.checkpoint)
  cfg.num_replicas, cfg.checkpoint.elastic, cfg.checkpoint.elastic_replicas = 8, "recreate", "3"
  assert resize.mode_for(meta, cfg.num_replicas, cfg.checkpoint) == "recreate"
  meta["config"]["checkpoint"].update(elastic="recreate", elastic_replicas="3")  # saved by the recreating run
  assert resize.mode_for(meta, cfg.num_replicas, cfg.checkpoint) is None


@pytest.mark.parametrize("field,value,message", [("elastic", "shrink", "one of '' | drop | recreate | grow"),
                                                 ("elastic_replicas", "4,x", "distinct replica ids"),
                                                 ("elastic_replicas", "4,4", "distinct replica ids")])
def test_bad_elastic_fields_are_one_line_errors(field, value, message):
  cfg = default.get_config("smoke")
  cfg.checkpoint.elastic = "drop"
  cfg.checkpoint[field] = value
  with pytest.raises(config_lib.ConfigError, match=f"config.checkpoint.{field}=.*{message}"):
    config_lib.validate(cfg)


def test_elastic_replicas_need_drop_or_recreate():
  cfg = default.get_config("smoke")
  cfg.checkpoint.elastic, cfg.checkpoint.elastic_replicas = "grow", "3"
  with pytest.raises(config_lib.ConfigError, match="elastic_replicas='3'.*unless checkpoint.elastic is 'drop' or 'recreate'"):
    config_lib.validate(cfg)


def test_host_checksums_are_the_saved_checksums():
  setup = build_lib.build(default.get_config("smoke"), vocab_size=257)
  state = setup.init_state()
  state = state.replace(params=jax.tree.map(lambda x: x + jax.numpy.arange(8.0).reshape((8,) + (1,) * (x.ndim - 1)).astype(x.dtype), state.params))
  host = jax.tree.map(np.asarray, state)
  assert resize.host_checksums(host) == checksum.state_checksums(state, setup.mesh)


def test_an_event_row_is_written_once_per_step(tmp_path):
  path = str(tmp_path / "pairings.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"round": 0, "step": 3, "groups": [[0, 1]]}) + "\n")
  for mode in ("drop", "drop", "grow"):  # a repeated resume, then another attempt from the same checkpoint
    logs.replace_row(path, {"step": 6, "round": 2, "elastic": mode})
  assert metrics_lib.read_jsonl(path) == [{"round": 0, "step": 3, "groups": [[0, 1]]},
                                          {"step": 6, "round": 2, "elastic": "grow"}]


# ---- A lost host: the 2-process job killed at step 8, resumed by the survivor ----

KILL_FLAGS = ["--config=configs/default.py:smoke", "--config.checkpoint_every=3", "--config.checkpoint.async_save=False"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """The workdir of a 2 × 4-device job whose process 1 (replicas 4-7) was killed after step 8."""
  root = tmp_path_factory.mktemp("elastic")
  workdir = root / "run"
  job = launch_local.Job(2, 4, KILL_FLAGS + [f"--workdir={workdir}"], log_dir=str(root / "logs"), cwd=REPO,
                         env=mp_env.env(NOLOCO_FAULTS="kill:process=1,step=8"))
  codes = job.wait(timeout_s=mp_env.JOB_TIMEOUT_S, grace_s=60)
  assert codes[1] == -9 and codes[0] != 0, (codes, "".join(open(p).read()[-2000:] for p in job.log_paths))
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())[-1] == 6
  return workdir


def saved_host_state(workdir, step: int = 6, n: int = 8) -> TrainState:
  """The checkpoint's state read whole into NumPy, independently of resize.py."""
  setup = build_lib.build(default.get_config("smoke"), vocab_size=257)
  item = jax.eval_shape(setup.init_state)
  item = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape[1:], x.dtype), item)
  reader = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), options=ocp.CheckpointManagerOptions(read_only=True))
  state = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=item, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item))))["state"]
  reader.close()
  return state


class _Data:
  def __init__(self):
    self.state = None

  def set_state(self, state):
    self.state = state


def restore_as(workdir, tmp_path, **fields):
  """(state, loop, data state set) as a survivor's resume with these config fields would start."""
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  cfg = default.get_config("smoke")
  cfg.num_devices = 4  # the survivor's devices
  for dotted, value in fields.items():
    node, *path = dotted.split("__")
    (cfg[node] if path else cfg)[path[0] if path else node] = value
  setup = build_lib.build(cfg)
  data = _Data()
  state, loop = checkpoint.Checkpointer(run_lib.checkpoint_info(setup), str(copy)).restore(
      jax.eval_shape(setup.init_state), data, LoopState())
  return jax.tree.map(np.asarray, state), loop, data.state, copy


def test_other_differences_than_the_replica_count_are_named():
  saved = {".params['w']": [[8, 3, 2], "float32"], ".step": [[8], "int32"]}
  same = {".params['w']": [[4, 3, 2], "float32"], ".step": [[4], "int32"]}
  pairing_of = lambda n, seed: {"mode": "fresh", "seed": seed, "group_size": 2, "num_replicas": n, "round": 2, "groups": []}
  assert resize.other_differences(saved, same, pairing_of(8, 0), pairing_of(4, 0)) is None
  wider = {**same, ".params['w']": [[4, 3, 4], "float32"]}
  assert "another shape" in resize.other_differences(saved, wider, pairing_of(8, 0), pairing_of(4, 0))
  assert "another pairing schedule" in resize.other_differences(saved, same, pairing_of(8, 0), pairing_of(4, 1))


def test_a_resized_read_verifies_the_saved_checksums(killed):
  setup = build_lib.build(default.get_config("smoke"), vocab_size=257)
  root = os.path.join(killed, "checkpoints")
  reader = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
  meta = reader.restore(6, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  reader.close()
  state = resize.read_host_state(root, 6, jax.eval_shape(setup.init_state), meta)
  assert_trees_equal(state, saved_host_state(killed))
  meta["state_checksums"][5] = "00" * 8  # replica 5's stored checksum no longer matches what is read
  with pytest.raises(checksum.StateChecksumError):
    resize.read_host_state(root, 6, jax.eval_shape(setup.init_state), meta)


def test_survivor_resume_without_the_flag_is_refused_naming_it(killed, tmp_path):
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=r"holds 8 replicas and config.num_replicas=4: resume with num_replicas=8, or set "
                           r"config.checkpoint.elastic=drop"):
    restore_as(killed, tmp_path, num_replicas=4)


def test_without_a_resize_the_survivor_resumes_the_same_replicas_to_the_end(killed, tmp_path):
  """The lost host's job, resumed as it was: the 8 replicas from step 6 on this process's 8 devices, to step
  12; the rows after the kill's checkpoint are written once."""
  workdir = tmp_path / "run"
  shutil.copytree(killed, workdir)
  cfg = default.get_config("smoke")
  cfg.checkpoint_every = 3
  result = training.train_and_evaluate(cfg, str(workdir))
  assert [e["step"] for e in result["history"]["eval"]][-1] == 12
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows if "train/loss" in r][-2:] == [9, 12]


@pytest.mark.parametrize("mode,fields,rows", [
    ("drop", {"num_replicas": 4}, [0, 1, 2, 3]),  # process 1's replicas 4-7 dropped
    ("recreate", {}, None),  # rows from the seeded schedule: checked below
    ("grow", {"num_replicas": 12}, None),
])
def test_survivor_resume_restores_the_rows_numpy_says(killed, tmp_path, mode, fields, rows):
  old = saved_host_state(killed)
  new, loop, data, _ = restore_as(killed, tmp_path, checkpoint__elastic=mode, **fields)
  assert loop.step == 6 and loop.round == 2
  cfg = config_lib.validate(default.get_config("smoke"))
  if mode == "recreate":
    schedule = pairing.PairingSchedule(seed=cfg.seed, num_replicas=8, group_size=2, mode=cfg.outer.pairing)
    partners = {r: reference_last_partner(schedule, 2, r, {4, 5, 6, 7}) for r in (4, 5, 6, 7)}
    rows = [r if r < 4 else partners[r] for r in range(8)]
    for r in [r for r in range(4, 8) if rows[r] is None]:  # never met a survivor: a seeded survivor
      rows[r] = int(permutations.generator(permutations.STREAM_ELASTIC, cfg.seed, 6, 2, r).integers(4))
    assert set(data["replicas"]) == {str(r) for r in range(8)}  # every stream at its saved position
  if mode == "grow":
    peers = resize.grow_peers(8, 12, seed=cfg.seed, step=6)
    rows = list(range(8)) + peers
    assert data is None  # dealt afresh: the new iterator starts at its beginning
    for j, p in enumerate(peers):
      assert_trees_equal(rows_of(new, [8 + j]).params, rows_of(old, [p]).outer["slow"])
      assert all(np.all(x == 0) for x in jax.tree.leaves(rows_of(new, [8 + j]).outer["momentum"]))
    assert_trees_equal(rows_of(new, range(8)), old)
    assert_trees_equal(rows_of(new, range(8, 12)).opt_state, rows_of(old, peers).opt_state)
    return
  assert_trees_equal(new, rows_of(old, rows))


def resume_job(workdir, log_dir, extra: list[str], processes: int) -> tuple[str, list[dict]]:
  """The same command plus `extra`, on `processes` × (4 / processes) devices; (process 0's log, metrics rows)."""
  job = launch_local.Job(processes, 4 // processes, KILL_FLAGS + [f"--workdir={workdir}"] + extra,
                         log_dir=str(log_dir), cwd=REPO, env=mp_env.env())
  codes = job.wait(timeout_s=mp_env.JOB_TIMEOUT_S, grace_s=30)
  text = open(job.log_paths[0]).read()
  assert codes == [0] * processes, text[-3000:]
  return text, metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


# The survivor alone (1 process, its 4 devices) drops or re-creates process 1's replicas; growing, a
# replacement host has joined it (2 processes × 2 devices): the resize is placed across processes.
_SIBLINGS = ("after a killed job, through the command line (grow stays, and drop and recreate from inside an "
             "overlap window)")


@pytest.mark.parametrize("mode,extra,processes,says", [
    pytest.param("drop", ["--config.num_replicas=4", "--config.checkpoint.elastic=drop"], 1,
                 "elastic resume (drop): 8 -> 4 replicas; dropped replicas [4, 5, 6, 7]",
                 marks=pytest.mark.exhaustive(reason="drop " + _SIBLINGS)),
    pytest.param("recreate", ["--config.checkpoint.elastic=recreate"], 1,
                 "elastic resume (recreate): 8 -> 8 replicas; re-created 4 from ",
                 marks=pytest.mark.exhaustive(reason="recreate " + _SIBLINGS)),
    ("grow", ["--config.num_replicas=12", "--config.checkpoint.elastic=grow"], 2,
     "elastic resume (grow): 8 -> 12 replicas; added 8 from "),
])
def test_killed_job_resumed_by_the_survivor_trains_to_the_end(killed, tmp_path, mode, extra, processes, says):
  workdir = tmp_path / "run"
  shutil.copytree(killed, workdir)
  text, rows = resume_job(workdir, tmp_path / "logs", extra, processes)
  assert says in text, text[-3000:]
  event = metrics_lib.read_jsonl(os.path.join(workdir, "elastic.jsonl"))
  assert len(event) == 1 and event[0]["elastic"] == mode and event[0]["step"] == 6
  if mode == "drop":
    assert event[0]["dropped"] == [4, 5, 6, 7]
  if mode == "recreate":
    assert sorted(event[0]["recreated_from"]) == ["4", "5", "6", "7"]
    assert all(0 <= v <= 3 for v in event[0]["recreated_from"].values())
  if mode == "grow":
    assert sorted(event[0]["added_from"]) == ["10", "11", "8", "9"]
  assert any(r.get("elastic") == mode for r in metrics_lib.read_jsonl(os.path.join(workdir, "pairings.jsonl")))
  change = [r for r in rows if "elastic/replicas_after" in r]
  assert change == [{"step": 6, "elastic/replicas_before": 8, "elastic/replicas_after": event[0]["replicas_after"],
                     "elastic/dropped": len(event[0]["dropped"]), "elastic/recreated": len(event[0]["recreated_from"]),
                     "elastic/added": len(event[0]["added_from"])}]
  train = [r for r in rows if "train/loss" in r]
  evals = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in train][-2:] == [9, 12] and [r["step"] for r in evals][-1] == 12
  assert all(np.isfinite(r["train/loss"]) for r in train) and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  pairs = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "pairings.jsonl")) if "groups" in r and r["step"] > 6]
  n = event[0]["replicas_after"]
  assert pairs and all(sorted(m for g in r["groups"] for m in g) == list(range(n)) for r in pairs)
  if processes > 1:
    return  # 2 processes on 2 cores cost twice the time: the repeat below is checked with 1
  # The same command again resumes the resized run's own last checkpoint as it is: nothing changes twice.
  text, _ = resume_job(workdir, tmp_path / "logs_again", extra + ["--config.num_steps=15"], processes)
  assert "elastic resume" not in text
  assert len(metrics_lib.read_jsonl(os.path.join(workdir, "elastic.jsonl"))) == 1


# ---- Elastic resume of an overlapped run, through the command line (issue 22: one state shape) ----


def _main(workdir, env, *flags) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke",
                         f"--workdir={workdir}", "--config.outer.overlap.steps=2", *flags], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=mp_env.JOB_TIMEOUT_S)


@pytest.mark.parametrize("mode,flags,replicas", [
    ("drop", ["--config.num_replicas=6", "--config.checkpoint.elastic=drop",
              "--config.checkpoint.elastic_replicas=1,6"], 6),
    ("recreate", ["--config.checkpoint.elastic=recreate", "--config.checkpoint.elastic_replicas=3"], 8),
    pytest.param("grow", ["--config.num_replicas=10", "--config.checkpoint.elastic=grow"], 10, marks=pytest.mark.exhaustive(
        reason="grow from inside an overlap window (grow through the command line: the killed job's resume; a new "
               "replica's in-flight merge: test_grow_inside_an_overlap_window_gives_new_replicas_a_merge_that_keeps_"
               "their_slow_weights; a window resumed and resized from the command line: drop and recreate here)")),
])
def test_elastic_resume_of_an_overlapped_run_from_inside_a_window(mode, flags, replicas, tmp_path, overlapped_run):
  """The step-4 checkpoint of an overlapped run (H = 3, τ = 2) holds an exchange in flight (sent at 3, merged
  at 5); drop, recreate and grow resume it from the command line and train to the end. Before the state had
  one shape, each crashed in resize.place on the missing in-flight buffer."""
  source, env = overlapped_run
  workdir = str(tmp_path / mode)
  shutil.copytree(source, workdir)
  done = _main(workdir, env, "--config.num_steps=8", *flags)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"elastic resume ({mode})" in done.stderr and "resumed from step 4" in done.stderr
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert np.isfinite(summary["eval/loss"])
  event = json.loads(open(os.path.join(workdir, "elastic.jsonl")).readline())
  assert event["elastic"] == mode and event["replicas_after"] == replicas


@pytest.fixture(scope="module")
def overlapped_run(tmp_path_factory):
  """An overlapped smoke run stopped after its step-4 checkpoint (an exchange in flight), from the command line."""
  root = tmp_path_factory.mktemp("overlapped")
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
             JAX_COMPILATION_CACHE_DIR=str(root / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  workdir = str(root / "run")
  done = _main(workdir, env, "--config.num_steps=8", "--config.checkpoint_every=4")
  assert done.returncode == 0, done.stderr[-3000:]
  meta = json.load(open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")))
  assert meta["driver"] == {"sent_at": 3}
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))  # resume from step 4, inside the window
  return workdir, env
