"""The asynchronous schedule in the trainer (outer.schedule='async'; training/rounds/asynchronous.py).

In one process: the config's one-line errors, the job layout check, and the driver's round against the
lock-step round (a group of three, equal progress: bit for bit). On real processes through the command
line (python -m noloco_jax.main under launch_local), each job on the smoke model:

- two processes at equal speed: the job equals the lock-step schedule's (to float32 round-off), and run
  again from its checkpoint of step 6, each process resumes exactly (bit for bit, logs included);
- three processes training while their rounds find partners (outer.overlap.steps), one killed mid-run
  (NOLOCO_FAULTS): the others train on without a restart and never pair with it again; started again,
  it takes its state from a live peer and pairs with them.

Each job takes 30–90 s on a loaded 2-core machine, most of it starting JAX in every process.
"""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax import export_hf
from noloco_jax import report
from noloco_jax import sample
from noloco_jax import training
from noloco_jax.asynchronous import job as job_lib
from noloco_jax.asynchronous import logs as async_logs
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.io.checkpoint import read as read_lib
from noloco_jax.outer import exchange, methods
from noloco_jax.outer import base as outer_base
from noloco_jax.runtime import launch_local
from noloco_jax.training import build as build_lib
from noloco_jax.training.rounds.asynchronous import AsyncRounds
from safetensors_reader import read_safetensors  # pylint: disable=g-bad-import-order
from test_codec_schedules import assert_bitwise  # pylint: disable=g-bad-import-order

ASYNC = ["--config.outer.schedule=async"]


def _smoke(**overrides):
  cfg = default.get_config("smoke")
  for key, value in overrides.items():
    node = cfg
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return cfg


@pytest.mark.parametrize("overrides,field", [
    ({"outer.kind": "diloco"}, "config.outer.schedule='async' is not valid: 'lockstep' with outer.kind='diloco'"),
    ({"outer.kind": "ddp"}, "config.outer.schedule='async' is not valid: 'lockstep' with outer.kind='ddp'"),
    ({"outer.kind": "epidemic"}, "config.outer.schedule='async' is not valid: 'lockstep' with outer.kind='epidemic'"),
    ({"num_stages": 2, "model.num_layers": 2}, "config.num_stages=2 is not valid"),
    ({"outer.overlap.steps": 3}, "config.outer.overlap.steps=3 is not valid"),  # τ < H (smoke: H = 3)
    ({"outer.offload": True}, "config.outer.offload=True is not valid"),
    ({"outer.pairing": "round_robin"}, "config.outer.pairing='round_robin' is not valid"),
    ({"outer.rule.group_size": 4}, "config.outer.rule.group_size=4 is not valid"),
    ({"nan_policy": "skip_round"}, "config.nan_policy='skip_round' is not valid"),
    ({"outer.asynchronous.max_wait_s": 0.0}, "config.outer.asynchronous.max_wait_s=0.0 is not valid"),
    ({"outer.asynchronous.partner_silence_s": 0.5}, "config.outer.asynchronous.partner_silence_s=0.5 is not valid: "
     "a number of seconds ≥ 1"),
    ({"outer.schedule": "eventually"}, "config.outer.schedule='eventually' is not valid"),
])
def test_unsupported_combinations_are_one_line_naming_the_field(overrides, field):
  cfg = _smoke(**{"outer.schedule": "async", "num_replicas": 4, **overrides})
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load(cfg)
  assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)


def test_gossip_and_noloco_are_accepted():
  for kind in ("noloco", "gossip"):
    assert config_lib.load(_smoke(**{"outer.schedule": "async", "outer.kind": kind, "num_replicas": 3})).outer.schedule == "async"


# Every codec (outer.codec): a message dtype, or a compression with error feedback.
CODECS = {"bfloat16": {"outer.codec.message_dtype": "bfloat16"}, "int8": {"outer.codec.compression": "int8"},
          "int4": {"outer.codec.compression": "int4"},
          "topk": {"outer.codec.compression": "topk", "outer.codec.topk_density": 0.05, "outer.codec.topk_bits": 2}}


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_is_accepted(codec):
  config = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 3, **CODECS[codec]}))
  assert (config.outer.codec.compression, config.outer.codec.message_dtype) != ("none", "float32")


def test_a_streamed_process_builds_one_set_of_round_programs_per_fragment():
  """outer.streaming.fragments = 3 in the asynchronous schedule (partners='own'): a process's setup (its own
  config, job.process_config) cuts the model into 3 fragments and holds no schedule of groupings (the
  partners are found at run time); its driver has a round every H/F steps, one set of programs per fragment
  (the rounds themselves against the lock-step streamed run: tests/test_codec_schedules.py)."""
  config = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 2, "outer.streaming.fragments": 3,
                                     "outer.streaming.partners": "own"}))
  local = build_lib.build(job_lib.process_config(config))
  assert len(local.fragments) == 3 and local.schedule is None
  driver = _driver(local, _Process(0))
  assert [driver.due(step) for step in range(1, 4)] == [True] * 3 and len(driver._programs) == 3  # pylint: disable=protected-access
  assert job_lib.session_options(config.outer, config.seed).fragments == 3
  with pytest.raises(config_lib.ConfigError, match=r"^config.outer.streaming.partners='shared' is not valid: 'own' "
                     r"with outer.schedule='async'"):
    config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 2, "outer.streaming.fragments": 3}))


def test_the_layout_is_one_replica_per_process():
  config = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 4}))
  job_lib.check_layout(config, 4)
  with pytest.raises(config_lib.ConfigError, match=r"config.num_replicas=4 is not valid: 3, the number of processes"):
    job_lib.check_layout(config, 3)
  with pytest.raises(config_lib.ConfigError, match=r"config.outer.schedule='async' is not valid: 'lockstep' in a job of one"):
    job_lib.check_layout(config, 1)
  local = job_lib.process_config(config)
  assert (local.num_replicas, local.num_devices, local.outer.schedule) == (1, 0, "async")


def test_the_command_line_refuses_a_layout_that_is_not_one_replica_per_process(tmp_path):
  """Before it connects to anything: one line naming the field, exit status 2."""
  env = launch_local.process_env(0, 2, 1, 1)  # a coordinator port nobody serves: it must not get that far
  done = subprocess.run([sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke",
                         f"--workdir={tmp_path}", *ASYNC, "--config.num_replicas=3"], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("noloco_jax: config.num_replicas=3 is not valid: 2, the number of processes"), last


@pytest.mark.parametrize("kind", ["noloco", "gossip"])
def test_the_command_line_refuses_an_async_job_of_one_replica(tmp_path, kind):
  """Issue 33, 3. Before: a one-process job with num_replicas=1 died in the stability analysis
  (ZeroDivisionError in outer/stability.averaging_shrink: N − 1 = 0), a traceback instead of the refusal
  that num_replicas=2 gets."""
  env = launch_local.process_env(0, 1, 1, 1)  # a job of one process (its coordinator is never reached)
  done = subprocess.run([sys.executable, "-m", "noloco_jax.main", "--config=configs/default.py:smoke",
                         f"--workdir={tmp_path}", *ASYNC, "--config.num_replicas=1", f"--config.outer.kind={kind}"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  assert "Traceback" not in done.stderr, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("noloco_jax: config.outer.schedule='async' is not valid: 'lockstep' in a job of one process"), last


def test_train_and_evaluate_alone_refuses_the_async_schedule_in_one_line(tmp_path):
  with pytest.raises(config_lib.ConfigError, match=r"^config.outer.schedule='async' is not valid: 'lockstep' outside"):
    training.train_and_evaluate(_smoke(**{"outer.schedule": "async", "num_replicas": 2}), str(tmp_path))


def _assert_same(got, want):
  """Two pytrees equal bit for bit, leaf by leaf (a failure names the leaf)."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(got)[0])
  for path, a, b in zip(paths, leaves, jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


class _Process:
  def __init__(self, slot):
    self.slot = slot


def _driver(setup, process) -> AsyncRounds:
  """The driver make_driver builds for `setup` (a process's own: job.process_config)."""
  c = setup.config
  return AsyncRounds(setup.method, setup.mesh, setup.state_shardings, setup.fragments, c.outer, seed=c.seed,
                     last_step=c.num_steps, process=process)


@pytest.mark.parametrize("codec", ["float32", "topk"])  # every codec on a toy: test_codec_schedules.py
def test_a_round_at_equal_progress_is_the_lockstep_round_bit_for_bit_and_compiles_nothing(codec):
  """Three replicas in one group, lock-step (exchange.group_mean on one device) and asynchronous (each
  member's own AsyncRounds: its message program, then `_combine` with the others' messages as the transport
  delivers them, and the merge), with every codec: the message (own term, payload, the codec's new residual) and the
  state after the round are the lock-step round's, bit for bit. A group of three
  (outer.asynchronous.match_odd='triple') runs programs compiled before the first step: nothing is
  compiled inside the round (its first triple used to compile its mean there, stalling 3.4-6.5 s)."""
  codec_fields = CODECS.get(codec, {})
  cfg = _smoke(**{"num_replicas": 3, "outer.rule.group_size": 3, "num_devices": 1, **codec_fields})
  setup = build_lib.build(cfg)
  parts = setup.method.parts
  state = setup.init_state()
  # Three different replicas: θ moved apart by seeded noise (φ still the common start), and, with error
  # feedback, a residual left by earlier rounds.
  leaves = jax.tree.leaves(state.params)
  keys = jax.random.split(jax.random.key(7), 2 * len(leaves))
  noisy = [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  state = state.replace(params=jax.tree.unflatten(jax.tree.structure(state.params), noisy))
  if "residual" in state.outer:
    residual = [0.001 * jax.random.normal(k, x.shape, jnp.float32) for x, k in zip(leaves, keys[len(leaves):])]
    state = state.replace(outer={**state.outer, "residual": jax.tree.unflatten(jax.tree.structure(state.params), residual)})
  states, own, payload, _ = jax.jit(parts.message)(state)  # the lock-step message program's
  # The lock-step round program (message, exchange, merge in one program) for the grouping (0, 1, 2).
  lockstep, _ = jax.jit(outer_base.round_of(parts)((((0, 1, 2),),), 1))(state, np.asarray(0, np.int32))
  async_cfg = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 3, **codec_fields}))
  local = build_lib.build(job_lib.process_config(async_cfg))
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
  one = lambda tree, i: jax.tree.map(lambda x: x[i:i + 1], tree)
  driver = _driver(local, _Process(0))
  driver._compile_ahead(one(state, 0))  # pylint: disable=protected-access  (what `start` does)
  for me in range(3):  # every slot's programs are the same: one driver plays each in turn
    driver._process = _Process(me)  # pylint: disable=protected-access
    # This process's message program: the lock-step message of its replica; it only reads the state.
    mine = jax.tree.map(jnp.copy, one(state, me))
    before = len(compiles)
    sent, _, codec_state = driver._compiled["message"](mine)  # pylint: disable=protected-access
    assert len(compiles) == before, compiles[before:]
    _assert_same((sent[0], sent[-1], codec_state), (one(own, me), one(payload, me), one(parts.codec_state(states), me)))
    _assert_same(mine, one(state, me))  # not donated; the residual commits with the merge, not here
    others = [s for s in range(3) if s != me]
    result = session_lib.RoundResult("exchanged", 0, (0, 1, 2), (0, 0, 0),
                                     [sent[-1]] + [one(payload, s) for s in others], [30, 30, 30])
    before = len(compiles)
    mean, progress = driver._combine(sent[0], result)  # pylint: disable=protected-access  (the round's thread)
    new_state = driver._compiled["merge"](mine, mean, codec_state)  # pylint: disable=protected-access
    driver._combine(sent[0], dataclasses.replace(result, progress=[30, 27, 24]))  # pylint: disable=protected-access
    assert len(compiles) == before, compiles[before:]  # the triple's programs, equal and weighted, were ready
    assert progress == 30.0
    assert_bitwise(new_state, one(lockstep, me), codec)
  driver.programs.close()


def test_the_message_program_reads_theta_and_phi_and_writes_the_message_once():
  """Bytes the driver's message program reads and writes (XLA's cost analysis) in model copies: c from θ and φ
  (3) and the norm ‖φ − θ‖ (2). It only reads the state (neither donated nor returned: returned undonated,
  XLA copied every leaf, 17) and returns the float32 payload once, as the own term too."""
  from noloco_jax.outer import programs as programs_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.tools import hlo as hlo_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 2, "model.d_model": 256}))
  local = build_lib.build(job_lib.process_config(cfg))
  driver = _driver(local, _Process(0))
  state = programs_lib.abstract(local.init_state())
  sent, _, codec_state = jax.eval_shape(driver.programs.jitted("message", state), state)
  assert codec_state == ()  # no residual to hand on
  assert len(sent) == 1 and jax.tree.structure(sent[0]) == jax.tree.structure(state.params)  # own = payload, once
  compiled = driver.programs._lower("message").compile()  # pylint: disable=protected-access
  copies = hlo_lib.bytes_accessed(compiled) / outer_base.tree_bytes(state.params)
  assert 5 - 0.05 <= copies <= 5 + 0.05, copies
  assert hlo_lib.parameter_copies(compiled.as_text()) == 0


def test_the_loop_thread_neither_waits_for_the_message_nor_forms_the_mean():
  """What the loop's thread does of a round with τ > 0 (issue 37: idle at 10 Mbit/s): at the boundary it
  dispatches the message program, which only reads the state (run.state stays the same arrays, none donated:
  the next inner step is dispatched at once); the round's own thread finds the group, exchanges, forms the
  group's mean (the combine program) and reads the joiners' requests from the store; at the merge the loop's
  thread runs the merge program alone (and serves a joiner, if one asked). The merge
  then gives what the message, mean and merge in order give (the equal-progress tests above: bit for bit)."""
  import threading  # pylint: disable=g-import-not-at-top
  from test_overlap import _ToyRun  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(_smoke(**{"outer.schedule": "async", "num_replicas": 2, "outer.overlap.steps": 2,
                                  **CODECS["int8"]}))
  local = build_lib.build(job_lib.process_config(cfg))
  run = _ToyRun(local.init_state())
  driver = _driver(local, _Process(0))
  driver.restore({})
  driver._record = {"progress": 0.0, "progress_step": 0}  # pylint: disable=protected-access  (what `start` does)
  driver._compile_ahead(run.state)  # pylint: disable=protected-access
  threads = collections.defaultdict(set)  # program -> the threads that called it

  def on_thread(name, program):
    def called(*args):
      threads[name].add(threading.current_thread().name)
      return program(*args)
    return called
  compiled = driver._compiled  # pylint: disable=protected-access
  for name in ("message", "merge", "combine2", "combine2w"):
    compiled[name] = on_thread(name, compiled[name])

  class Session:
    def round(self, message, progress, step=None, fragment=0):
      del step, fragment
      threads["round"].add(threading.current_thread().name)
      sent.append(message)
      return session_lib.RoundResult("exchanged", 0, (0, 1), (0, 0), [message, message], [progress, progress - 3])

    def join_requests(self):
      threads["join_requests"].add(threading.current_thread().name)
      return {}

    def serve_joins(self, state_fn, progress, requests=None):
      del state_fn, progress, requests
      threads["serve_joins"].add(threading.current_thread().name)
      return 0

    def close(self, **kwargs):
      del kwargs

  driver.session, sent = Session(), []
  H = cfg.outer.inner_steps
  before = run.state
  payload = jax.jit(local.method.parts.message)(jax.tree.map(jnp.copy, run.state))[2]
  driver.after_step(run, H, {})  # the boundary: the message, the round sent
  assert run.state is before and not any(x.is_deleted() for x in jax.tree.leaves(run.state))
  run.state = jax.jit(lambda s: s.replace(step=s.step + 1), donate_argnums=0)(run.state)  # the next inner step
  driver.before_step(run, H + 2)
  driver.after_step(run, H + 2, {})  # τ steps on: merged
  assert driver._inflight.sent_at == 0 and run.loop.round == 1  # pylint: disable=protected-access
  main = threading.current_thread().name
  assert threads["message"] == threads["merge"] == {main}
  # The group, the exchange, the mean (unequal progress: weighted) and the store read for joiners: the round's thread.
  assert threads["round"] == threads["combine2w"] == threads["join_requests"] == {"async-round_0"}, dict(threads)
  assert "combine2" not in threads and "serve_joins" not in threads  # no joiner asked: nothing to serve
  _assert_same(sent[0], payload)  # the message read the state before the inner step that donated it
  driver.close(failed=False)


# ---- On real processes ----


def _job_logs(root):
  d = os.path.join(root, "logs")
  return "\n".join(f"--- {n}\n" + open(os.path.join(d, n)).read()[-4000:] for n in sorted(os.listdir(d))
                   if os.path.isfile(os.path.join(d, n)))


def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _final(process_dir):
  snapshot = read_lib.read(process_dir)
  rows = _jsonl(os.path.join(process_dir, "metrics.jsonl"))
  return snapshot, [{k: v for k, v in r.items() if not k.startswith("perf/") and "_s" not in k} for r in rows]


def test_equal_speeds_are_lockstep_noloco_and_each_process_resumes_exactly(tmp_path):
  """Two processes at equal speed: every round pairs them at equal progress, so the job is deterministic.
  Run once to the end; then again, killed (SIGKILL, both processes) after step 7 or 8: each process's logs then
  hold the rows its checkpoint of step 6 covers (on disk before it), and, run once more, it resumes from
  that checkpoint, drops the rows written after it, and ends bit for bit where the first run did, its
  logs included (metrics, pairings: every row once). Both match the lock-step schedule's run of the same
  config to float32 round-off (the update is the same bit for bit, tests above; a one-replica program on
  one device and the lock-step's program over a two-device mesh are compiled differently and differ in
  the last bits). No round compiled anything (every program is compiled before the first step)."""
  root = str(tmp_path)
  first_dir, second_dir = os.path.join(root, "first"), os.path.join(root, "second")
  flags = lambda workdir: ["--config=configs/default.py:smoke", f"--workdir={workdir}", *ASYNC, "--config.num_replicas=2",
                           "--config.checkpoint_every=6", "--config.checkpoint.async_save=False",
                           "--config.outer.asynchronous.max_wait_s=120"]
  pairings = lambda d, slot: _jsonl(os.path.join(d, f"process_{slot}", f"pairings_{slot}.jsonl"))
  first = launch_local.Job(2, 1, flags(first_dir), log_dir=os.path.join(root, "logs"))
  assert first.wait(timeout_s=600, grace_s=30) == [0, 0], _job_logs(root)
  # Process 1 first (after its checkpoint of step 6), then process 0, which hosts the coordination service:
  # its death would end a process still running (the order is what makes both deaths SIGKILLs).
  killed = launch_local.Job(2, 1, flags(second_dir), log_dir=os.path.join(root, "killed", "logs"),
                            env={"NOLOCO_FAULTS": "kill:process=1,step=7;kill:process=0,step=8"})
  assert killed.wait(timeout_s=600, grace_s=30) == [-9, -9], _job_logs(os.path.join(root, "killed"))
  for slot in (0, 1):  # what the checkpoint of step 6 covers is on disk
    assert os.path.isdir(os.path.join(second_dir, f"process_{slot}", "checkpoints", "6"))
    assert [p["step"] for p in pairings(second_dir, slot)] == [3, 6]
  again = launch_local.Job(2, 1, flags(second_dir), log_dir=os.path.join(root, "again", "logs"))
  assert again.wait(timeout_s=600, grace_s=30) == [0, 0], _job_logs(os.path.join(root, "again"))
  reference = training.train_and_evaluate(_smoke(**{"num_replicas": 2, "num_devices": 2}), os.path.join(root, "lockstep"))
  for slot in (0, 1):
    (snapshot, rows), (resumed, rows_again) = (_final(os.path.join(d, f"process_{slot}")) for d in (first_dir, second_dir))
    assert snapshot.step == resumed.step == 12
    for got, want in zip(jax.tree.leaves((resumed.params, resumed.slow)), jax.tree.leaves((snapshot.params, snapshot.slow))):
      np.testing.assert_array_equal(got, want)  # resumed exactly
    assert rows_again == rows  # every row once, the same values (the resume dropped the rows after step 6)
    for got, want in zip(jax.tree.leaves((snapshot.params, snapshot.slow)),
                         jax.tree.leaves((reference["state"].params, reference["state"].outer["slow"]))):
      np.testing.assert_allclose(got[0], np.asarray(want)[slot], rtol=1e-4, atol=1e-6)
    for d in (first_dir, second_dir):  # the resumed run's pairing rows: each round once, as the first run's
      assert [(p["step"], p["status"], p["group"], p["progress"]) for p in pairings(d, slot)] == [
          (s, "exchanged", [0, 1], s) for s in (3, 6, 9, 12)]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [3, 6, 9, 12]
    assert train[-1]["async/exchanged_rounds"] == 4 and train[-1]["async/skipped_rounds"] == 0
    assert all(r["async/round_compiles"] == 0 for r in train)
  # The job's own result (issue 34 item 8), written by process 0 once the other had finished: at equal
  # progress the consensus is the plain mean of φ, and the figures are the lock-step job's.
  with open(os.path.join(first_dir, "summary.json")) as f:
    job = json.load(f)
  assert job["job"] == "asynchronous" and job["processes"] == [0, 1]
  assert [(p["ended"], p["checkpoint_step"], p["consensus_weight"]) for p in job["per_process"].values()] == [
      ("finished", 12, 0.5)] * 2
  np.testing.assert_allclose(job["eval/consensus_loss"], reference["eval/consensus_loss"], rtol=1e-5)
  np.testing.assert_allclose(job["eval/loss"], reference["eval/loss"], rtol=1e-5)
  np.testing.assert_allclose(job["replicas/weight_std"], reference["replicas/weight_std"], rtol=1e-3)
  # The tools after a run, on the job's workdir (issue 33 item 8): the consensus is the job's.
  out = os.path.join(root, "hf")
  assert export_hf.main([first_dir, "--out", out, "--consensus"]) == 0
  exported = read_safetensors(os.path.join(out, "model.safetensors"))
  want = export_hf.hf_state_dict(jax.tree.map(lambda x: np.mean(np.asarray(x), 0), reference["state"].outer["slow"]))
  for name, value in want.items():
    np.testing.assert_allclose(exported[name], value, rtol=1e-4, atol=1e-6)
  assert report.main([first_dir, "--no-png"]) == 0 and sample.main([first_dir, "--replica", "1", "--prompt", "def ",
                                                                      "--length", "4"]) == 0


def _wait_for(predicate, timeout_s, what):
  end = time.time() + timeout_s
  while time.time() < end:
    if predicate():
      return
    time.sleep(1.0)
  raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_killed_process_is_left_behind_and_rejoins_from_a_live_peer(tmp_path):
  root = str(tmp_path)
  workdir = os.path.join(root, "run")
  flags = ["--config=configs/default.py:smoke", f"--workdir={workdir}", *ASYNC, "--config.num_replicas=3",
           "--config.num_steps=100000", "--config.eval_every=0", "--config.log_every=3", "--config.outer.asynchronous.lease_s=3",
           "--config.outer.asynchronous.max_wait_s=2", "--config.outer.asynchronous.exchange_timeout_s=10",
           "--config.outer.overlap.steps=2"]  # rounds on their own thread while the steps go on (τ = 2 of H = 3)
  slow = "delay:seconds=0.1"
  job = launch_local.Job(3, 1, flags, log_dir=os.path.join(root, "logs"), env={"NOLOCO_FAULTS": f"{slow};kill:process=2,step=9"})
  procs = list(job.procs)
  pairings = lambda s: _jsonl(os.path.join(workdir, f"process_{s}", f"pairings_{s}.jsonl"))
  try:
    assert procs[2].wait(timeout=600) == -9, _job_logs(root)
    old = pairings(2)[-1]
    env = launch_local.process_env(2, 3, 1, job.port, {"NOLOCO_FAULTS": slow})
    with open(os.path.join(root, "logs", "process_2_again.log"), "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "noloco_jax.main", *flags], env=env, stdout=log,
                                    stderr=subprocess.STDOUT))
    new_exchanged = lambda: [p for s in (0, 1) for p in pairings(s)
                             if p["status"] == "exchanged" and 2 in p["group"] and old["incarnation"] not in p["incarnations"]]
    _wait_for(lambda: len(new_exchanged()) >= 2, 400, "the restarted process to exchange with the others")
    for p in procs[:2] + procs[3:]:  # SIGTERM: each saves and stops; process 0 then waits for the others
      p.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p in procs[:2] + procs[3:]] == [0, 0, 0], _job_logs(root)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  new = pairings(2)[-1]["incarnation"]
  for slot in (0, 1):
    logged = [e for e in _jsonl(os.path.join(workdir, f"process_{slot}", f"membership_{slot}.jsonl")) if "incarnation" in e]
    events = [(e["slot"], str(e["incarnation"]), e["event"]) for e in logged]
    assert (2, old["incarnation"], "lost") in events and (2, new, "joined") in events, events
    lost_at = min(e["time"] for e in logged if (e["slot"], str(e["incarnation"]), e["event"]) == (2, old["incarnation"], "lost"))
    mine = pairings(slot)
    # Never grouped with the dead incarnation once seen lost (the restart can join within the lease, so
    # this is read from the loss, not from the lease's end); trained on meanwhile.
    after = [p for p in mine if p["time"] > lost_at]
    assert after and all(old["incarnation"] not in p["incarnations"] for p in after)
    rows = [r for r in _jsonl(os.path.join(workdir, f"process_{slot}", "metrics.jsonl")) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(3, 3 * len(rows) + 1, 3))  # every row, no restart, nothing lost
    assert all(r["async/round_compiles"] == 0 for r in rows)  # three processes: groups of three were ready too
  # The restarted process took a live peer's state and step, and trained on from there.
  joined = [json.loads(line) for line in open(os.path.join(workdir, "process_2", "membership_2.jsonl"))
            if '"joined_from"' in line]
  assert joined and joined[-1]["donor"] in (0, 1)
  # What it received is bit for bit what the donor served it (θ, φ, δ, the inner optimiser state and step).
  served = [e for e in _jsonl(os.path.join(workdir, f"process_{joined[-1]['donor']}",
                                           f"membership_{joined[-1]['donor']}.jsonl"))
            if e.get("event") == "served_join" and str(e["incarnation"]) == new]
  assert [e["digest"] for e in served] == [joined[-1]["digest"]]
  rows = [r for r in _jsonl(os.path.join(workdir, "process_2", "metrics.jsonl")) if "train/loss" in r]
  assert rows and rows[0]["step"] > 9, rows  # its first row after the donor's step (not after step 0)
  # Whoever reads the job merges the per-process logs.
  merged = async_logs.merge(workdir)
  assert merged["processes"] == [0, 1, 2] and {r["process"] for r in merged["metrics"]} == {0, 1, 2}
  text = "\n".join(async_logs.summary(merged))
  assert "slot 2 lost" in text and "slot 2 joined from slot" in text, text
