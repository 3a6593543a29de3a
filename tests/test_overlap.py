"""Streaming overlap (outer.overlap.steps = τ, outer.overlap.mix = λ): the delayed merge against NumPy over
whole round sequences (plain and compressed messages), mesh = one device, the split round = the plain one,
bytes, bad input, exact resume."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import wire
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.training import loop as train
from noloco_jax.training.loop_state import LoopState
from noloco_jax.training.rounds import OverlappedRounds
from test_compression import assert_one_line_config_error, np_dense_roundtrip, np_topk_roundtrip
import hlo_helpers  # pylint: disable=g-bad-import-order  (tests/hlo_helpers.py)

N = 8
SHAPES = {"w": (6, 5), "b": (3,)}


def _outer_cfg(**kw):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kw)
  return cfg


def _targets(seed):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}


# ---- A whole overlapped run of a toy inner step, against a plain NumPy simulation ----


def np_sent(c, fresh, slow, residual, codec):
  """What one replica's message becomes on the wire (decoded), and its new error-feedback residual.

  codec None: the plain float32 message. Else (compression, decay, chunk, density, bits): int8 / int4
  quantise m = c + e; topk sparsifies m = β(θ − φ) + e and sends γφ as int8."""
  if codec is None:
    return c, residual
  compression, decay, chunk, density, bits = codec
  if compression == "topk":
    m = fresh + residual
    sparse = np_topk_roundtrip(m, density, bits, chunk)
    return sparse + np_dense_roundtrip(slow, 8, chunk), decay * (m - sparse)
  m = c + residual
  sent = np_dense_roundtrip(m, {"int8": 8, "int4": 4}[compression], chunk)
  return sent, decay * (m - sent)


def np_overlapped_run(theta0, targets, schedule, *, steps, H, tau, lr, alpha, beta, gamma, mix, codec=None, send=None,
                      skip_rounds=(), commit_skipped=False, with_residual=False):
  """Every replica takes SGD steps on ½‖θ − a_i‖²; round t's message leaves at step tH and its group mean
  (own exact c, the partners' messages as decoded from the wire) is merged after step tH + τ (or the last
  step): φ, δ by the NoLoCo rule, θ ← λ·θ_local + (1 − λ)·φ. The codec's residual updates at the send.

  `send(c, fresh, slow, residual) -> (decoded, new residual)`: the codec (default np_sent with `codec`).
  `skip_rounds`: rounds whose exchange failed (asynchronous schedule): nothing merged and, unless
  `commit_skipped`, the residual left as it was. `with_residual`: also return the residual."""
  send = send or (lambda c, fresh, slow, residual: np_sent(c, fresh, slow, residual, codec))
  f64 = lambda t: {k: v.astype(np.float64) for k, v in t.items()}
  theta, phi = f64(theta0), f64(theta0)
  delta = {k: np.zeros_like(v) for k, v in theta.items()}
  residual = {k: np.zeros_like(v) for k, v in theta.items()}
  targets = f64(targets)
  in_flight, round_ = None, 0
  for step in range(1, steps + 1):
    theta = {k: theta[k] - lr * (theta[k] - targets[k]) for k in theta}
    if step % H == 0:
      groups = schedule.groups(round_)
      mean_c = {}
      for k in theta:
        c = beta * theta[k] + (gamma - beta) * phi[k]
        sent = np.empty_like(c)
        for j in range(len(c)):
          sent[j], new_residual = send(c[j], beta * (theta[k][j] - phi[k][j]), gamma * phi[k][j], residual[k][j])
          if round_ not in skip_rounds or commit_skipped:
            residual[k][j] = new_residual
        mean_c[k] = np.empty_like(c)
        for group in groups:
          for i in group:
            mean_c[k][i] = (c[i] + sum(sent[j] for j in group if j != i)) / len(group)
      if round_ not in skip_rounds:
        in_flight, sent_at = mean_c, step
      round_ += 1
    if in_flight is not None and (step == sent_at + tau or step == steps):
      for k in theta:
        delta[k] = alpha * delta[k] + in_flight[k] - gamma * phi[k]
        phi[k] = phi[k] + delta[k]
        theta[k] = mix * theta[k] + (1 - mix) * phi[k]
      in_flight = None
  return (theta, phi, delta, residual) if with_residual else (theta, phi, delta)


class _ToyRun:
  """What a round driver reads and writes of a run (training/run.Run): the state and the loop record."""

  def __init__(self, state):
    self.state, self.loop = state, LoopState()


def drive(driver, method, mesh, theta0, targets, *, steps, lr):
  """The loop's calls (training/loop.py) to a round driver around a jitted toy inner step (θ ← θ − lr·(θ − target)),
  from θ0 on the replica layout of `mesh`: the run, after `steps` steps. Shared by the drivers' tests."""
  sharding = mesh_lib.replica_sharding(mesh)
  n = jax.tree.leaves(theta0)[0].shape[0]
  state = TrainState(step=np.zeros(n, np.int32), params=theta0, opt_state=(), outer=method.init(theta0))
  run = _ToyRun(jax.device_put(state, sharding))
  targets = jax.device_put(targets, sharding)
  inner = jax.jit(lambda s, a: s.replace(params=jax.tree.map(lambda t, x: t - lr * (t - x), s.params, a)),
                  donate_argnums=0)
  driver.start(run)
  try:
    for step in range(1, steps + 1):
      driver.before_step(run, step)
      run.state = inner(run.state, targets)
      driver.after_step(run, step, {})
  finally:
    driver.close(failed=False)
  return run


def _toy_run(method, schedule, num_devices, theta0, targets, *, steps, H, tau, lr, mix):
  """The overlapped round driver's run (`drive`)."""
  mesh = mesh_lib.make_mesh(N, num_devices)
  driver = OverlappedRounds(method, mesh, schedule, None, inner_steps=H, tau=tau, mix=mix, last_step=steps,
                            traffic=wire.NOTHING, threaded=False)
  run = drive(driver, method, mesh, theta0, targets, steps=steps, lr=lr)
  assert not driver.sent_at and driver.save() == {} and run.loop.round == steps // H
  return jax.tree.map(np.asarray, run.state)


@pytest.mark.parametrize("kind,tau,mix,steps,compression", [
    ("noloco", 2, 0.5, 13, "none"), ("gossip", 3, 0.3, 12, "none"), ("noloco", 1, 0.0, 9, "none"),
    ("noloco", 2, 0.5, 13, "int8"), ("noloco", 3, 0.5, 12, "topk"), ("gossip", 1, 0.3, 9, "int4")])
def test_overlapped_rounds_match_numpy_and_mesh_equals_one_device(kind, tau, mix, steps, compression):
  """Compression composes with overlap: the codec is a parameter of the exchange, and its error-feedback
  residual is updated when the message is sent."""
  H, lr = 4, 0.3
  codec = dict(compression=compression, chunk=16, topk_density=0.25, topk_bits=4, slow_codec="int8", feedback_decay=1.0)
  method = outer_lib.make(_outer_cfg(kind=kind, inner_steps=H, rule=dict(outer_momentum=0.5, outer_lr=0.7, consensus_weight=0.9),
                                     codec=codec, overlap=dict(steps=tau, mix=mix)))
  schedule = pairing.PairingSchedule(seed=4, num_replicas=N, group_size=2, mode="fresh")
  theta0 = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in _targets(0).items()}  # replicas start equal
  targets = _targets(1)
  got = {d: _toy_run(method, schedule, d, theta0, targets, steps=steps, H=H, tau=tau, lr=lr, mix=mix) for d in (N, 1)}
  alpha, beta, gamma = (0.0, 1.0, 1.0) if kind == "gossip" else (0.5, 0.7, 0.9)
  codec = None if compression == "none" else (compression, 1.0, 16, 0.25, 4)
  theta, phi, delta = np_overlapped_run(theta0, targets, schedule, steps=steps, H=H, tau=tau, lr=lr, alpha=alpha,
                                        beta=beta, gamma=gamma, mix=mix, codec=codec)
  for k in SHAPES:
    np.testing.assert_allclose(got[N].params[k], theta[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got[N].outer["slow"][k], phi[k], rtol=1e-5, atol=2e-5)
    if kind == "noloco":  # gossip overwrites δ every round and never reads it
      np.testing.assert_allclose(got[N].outer["momentum"][k], delta[k], rtol=1e-5, atol=2e-5)
  # The mesh (ppermutes, a program per fresh grouping) and one device (the grouping as a gather table):
  # bitwise with plain messages. A quantiser's message program is compiled for [1, ...] stacks on the
  # mesh and [8, ...] on one device, and XLA rounds its extreme value (255 · (M / 255)) differently in
  # the two; that reaches only the error-feedback residual, by about one float32 ulp of the chunk's scale.
  for a, b in zip(jax.tree.leaves(got[N]), jax.tree.leaves(got[1])):
    if compression == "none":
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())))
  # The replicas moved apart between rounds and were pulled together by the merges: not a trivial run.
  assert np.std(got[N].params["w"], axis=0).max() > 1e-3


def test_send_then_merge_with_no_steps_between_and_mix_0_is_the_plain_round_bitwise():
  """τ = 0 runs the plain round (the golden test); the split round is the same arithmetic: message and
  group mean as the plain round, φ and δ by the same rule, and with λ = 0 θ ← φ."""
  method = outer_lib.make(_outer_cfg(rule=dict(consensus_weight=0.9), overlap=dict(steps=1, mix=0.0)))
  rng = np.random.default_rng(3)
  theta = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
  outer = {"slow": jax.tree.map(lambda x: x + 0.1, theta), "momentum": jax.tree.map(lambda x: 0.01 * x, theta),
           "inflight": jax.tree.map(np.zeros_like, theta)}
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=1, num_replicas=N, group_size=2, mode="fixed")
  make = lambda: jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=outer),
                                mesh_lib.replica_sharding(mesh))
  key, route = schedule.plan(0, N)
  plain, _ = programs_lib.make_round_fn(method, mesh, key)(make(), route)
  programs = programs_lib.RoundPrograms(method, mesh, schedule, where="exchange", mix=0.0)
  state = make()
  state, sent, _ = programs.jitted("message", programs_lib.abstract(state))(state)
  assert len(sent) == 1  # the float32 payload is the own term: sent once, read as both
  mean = programs.jitted(key)(*sent, route)
  split = programs.jitted("merge")(state.replace(outer={**state.outer, "inflight": mean}))
  pick = lambda s: (s.params, s.outer["slow"], s.outer["momentum"])  # the in-flight buffer: the plain round's is unused
  for a, b in zip(jax.tree.leaves(pick(plain)), jax.tree.leaves(pick(split))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("message_dtype", ["float32", "bfloat16"])
def test_overlapped_send_moves_the_bytes_counted_per_round(message_dtype):
  method = outer_lib.make(_outer_cfg(codec=dict(message_dtype=message_dtype), overlap=dict(steps=2)))
  params = {"w": np.zeros((N, 96, 128), np.float32), "b": np.zeros((N, 5), np.float32)}
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  programs = programs_lib.RoundPrograms(method, mesh, schedule, where="exchange", mix=0.5)
  key, _ = programs.plan(0)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=params, opt_state=(),
                                    outer=method.init(params)), mesh_lib.replica_sharding(mesh))
  programs.jitted("message", programs_lib.abstract(state))
  assert len(programs._structs["sent"]) == (1 if message_dtype == "float32" else 2)  # bfloat16: not the own term
  lowered = programs._lower(key)
  hlo = lowered.compile().as_text()
  counted = method.traffic(jax.tree.map(lambda x: x[0], params), N)[0].operand
  itemsize = 2 if message_dtype == "bfloat16" else 4
  assert counted == (96 * 128 + 5) * itemsize  # one copy per replica per round (n = 2)
  assert hlo_helpers.stablehlo_collective_bytes(lowered.as_text()) == counted
  # XLA:CPU widens bf16 collectives to f32 after lowering (as for the plain round, tests/test_outer.py).
  assert hlo_lib.collective_bytes(hlo, "collective-permute") == counted * (4 // itemsize)
  assert hlo_lib.all_collective_bytes(hlo).keys() == {"collective-permute"}
  # On the wire (outer/wire.py, what an overlapped run's comm/bytes_sent_per_replica adds up): the plain
  # round's message, sent and received once per round, as the compiled exchange carries it.
  on_wire, _ = method.traffic(jax.tree.map(lambda x: x[0], params), N)
  priced = hlo_lib.wire_bytes(hlo, N)["across"]
  assert on_wire.sent == on_wire.received == on_wire.operand == counted
  np.testing.assert_array_equal(priced.sent, np.full(N, counted * (4 // itemsize)))
  np.testing.assert_array_equal(priced.received, np.full(N, counted * (4 // itemsize)))
  # The message and the merge programs communicate nothing.
  for name in ("message", "merge"):
    assert hlo_lib.all_collective_bytes(programs._lower(name).compile().as_text()) == {}  # pylint: disable=protected-access


# ---- Bad input: one line naming the field ----


@pytest.mark.parametrize("overrides,field", [
    ({"outer.overlap.steps": 3}, "outer.overlap.steps"),  # smoke: H = 3
    ({"outer.overlap.steps": -1}, "outer.overlap.steps"),
    ({"outer.overlap.steps": 1, "outer.overlap.mix": 1.5}, "outer.overlap.mix"),
    ({"outer.overlap.mix": -0.1}, "outer.overlap.mix"),
    ({"outer.overlap.steps": 1, "outer.kind": "diloco"}, "outer.overlap.steps"),
    ({"outer.overlap.steps": 1, "outer.kind": "epidemic"}, "outer.overlap.steps"),
    ({"outer.overlap.steps": 1, "nan_policy": "skip_round"}, "outer.overlap.steps"),
])
def test_bad_overlap_settings_name_the_field(overrides, field):
  assert_one_line_config_error(overrides, field)


# ---- End to end: a run stopped inside a window resumes bitwise, the in-flight mean from disk ----


def test_overlapped_training_resumes_bitwise_from_inside_a_window(tmp_path, caplog, compile_cache):
  del compile_cache  # the resumed run reuses the first one's programs (tests/conftest.py)
  config = default.get_config("smoke")
  # H = 3, τ = 2: sent at 3, merged at 5; sent at 6, merged at 8 (the last step). Saved at 4: in flight.
  config.num_steps, config.checkpoint_every, config.checkpoint.keep, config.eval_every = 8, 4, 3, 4
  config.outer.overlap.update(steps=2, mix=0.5)
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  assert 0 < first["eval/loss"] < np.log(257)  # it learned
  meta = json.load(open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")))
  assert meta["driver"] == {"sent_at": 3} and meta["round"] == 1
  assert any(k.startswith(".outer['inflight']") for k in meta["state_shapes"])
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  with caplog.at_level("INFO"):
    second = train.train_and_evaluate(config, workdir)
  assert "resumed from step 4" in caplog.text
  assert set(first["state"].outer) == {"slow", "momentum", "inflight"}  # one state shape, in flight or not
  for a, b in zip(jax.tree.leaves(first["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert first["comm/collective_operand_bytes_per_replica"] == second["comm/collective_operand_bytes_per_replica"]


# ---- Two processes over loopback: the send on a second thread (outer/overlap.py), same numbers ----


def test_two_processes_with_the_threaded_send_match_one_process(tmp_path):
  """2 processes × 1 device take the threaded exchange (threaded_exchange_is_safe); an evaluation (6), the stop
  agreement (6) and a checkpoint (4) fall inside windows and wait for the exchange. Same metrics as one
  process, whose send is dispatched in order."""
  from noloco_jax.io import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  import mp_env  # pylint: disable=g-import-not-at-top

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  overrides = {"num_replicas": 2, "checkpoint_every": 4, "outer.overlap.steps": 2}
  workdir = tmp_path / "two"
  job = launch_local.Job(2, 1, ["--config=configs/default.py:smoke", f"--workdir={workdir}"]
                         + [f"--config.{k}={v}" for k, v in overrides.items()],
                         log_dir=str(tmp_path / "logs"), cwd=repo, env=mp_env.env())
  codes = job.wait(timeout_s=480, grace_s=30)
  assert codes == [0, 0], "".join(open(p).read()[-3000:] for p in job.log_paths)
  assert "the exchange is called on a second thread" in open(job.log_paths[0]).read()
  config = default.get_config("smoke")
  config.num_replicas, config.checkpoint_every = 2, 4
  config.outer.overlap.steps = 2
  train.train_and_evaluate(config, str(tmp_path / "one"))

  def rows(path):  # timings left out, and the per-round weight std only a one-process job logs
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and not (k == "replicas/weight_std" and "train/loss" in r)}
            for r in metrics_lib.read_jsonl(os.path.join(path, "metrics.jsonl"))]

  got, want = rows(workdir), rows(tmp_path / "one")
  assert [r["step"] for r in got] == [r["step"] for r in want] and len(want) > 4
  for g, w in zip(got, want):
    assert g.keys() == w.keys(), (g, w)
    for key in w:
      np.testing.assert_allclose(g[key], w[key], rtol=1e-5, err_msg=f"step {w['step']} {key}")
  meta = json.load(open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")))
  assert meta["driver"] == {"sent_at": 3}


def test_the_loop_state_keeps_the_drivers_record_and_the_late_weight_std():
  from noloco_jax.training.loop_state import LoopState  # pylint: disable=g-import-not-at-top

  loop = LoopState(step=4, round=1, comm_bytes=8)
  loop.add_round(4, {"pseudo_grad_norm": np.ones(2, np.float32)}, wire.permute(8), applied=False)  # sent: std not known yet
  loop.driver = {"sent_at": 4}  # OverlappedRounds.save
  back = LoopState.from_record(json.loads(json.dumps(loop.to_record())))
  assert back.driver == {"sent_at": 4} and back.round == 2
  # Checkpoints from before the driver kept its record: the step in flight, or none, where it was then.
  old = {k: v for k, v in loop.to_record().items() if k != "driver"}
  assert LoopState.from_record({**old, "inflight_step": 3}).driver == {"sent_at": 3}
  assert LoopState.from_record({**old, "inflight_step": 0}).driver == {} == LoopState.from_record(old).driver
  history = {**old["history"], "async": {"progress": 6.0, "progress_step": 6}, "schedule": {"async/exchanged_rounds": 2}}
  back = LoopState.from_record({**old, "history": history})
  assert back.driver == {"progress": 6.0, "progress_step": 6, "counts": {"async/exchanged_rounds": 2}}
  assert "async" not in back.history and "schedule" not in back.history
  loop.set_round_weight_std(0.5)  # at the merge
  assert loop.pending_rounds[-1][1] == 0.5
  loop.take_pending()
  loop.set_round_weight_std(0.7)  # the round was logged before its merge: nothing to set
  assert loop.pending_rounds == []


def test_the_merge_keeps_every_dtype_with_a_bfloat16_outer_state():
  """outer.state_dtype wraps the message and the merge as it wraps the plain round (methods.with_state_dtype);
  the in-flight mean stays float32 (a message, not stored state)."""
  method = outer_lib.make(_outer_cfg(state_dtype="bfloat16", codec=dict(compression="int8"), overlap=dict(steps=1)))
  theta = _targets(2)
  mesh = mesh_lib.make_mesh(N, N)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer=method.init(theta)),
                         mesh_lib.replica_sharding(mesh))
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fixed")
  run = _ToyRun(state)
  before = jax.tree.map(lambda x: x.dtype, state)
  driver = OverlappedRounds(method, mesh, schedule, None, inner_steps=1, tau=0, mix=0.5, last_step=1,
                            traffic=wire.NOTHING, threaded=False)
  driver.start(run)
  driver.after_step(run, 1, {})  # sent and (the last step) merged at once
  driver.close(failed=False)
  assert jax.tree.map(lambda x: x.dtype, run.state) == before
  dtypes = {k: {x.dtype for x in jax.tree.leaves(v)} for k, v in run.state.outer.items()}
  assert dtypes == {"slow": {jnp.dtype(jnp.bfloat16)}, "momentum": {jnp.dtype(jnp.bfloat16)},
                    "residual": {jnp.dtype(jnp.bfloat16)}, "inflight": {jnp.dtype(jnp.float32)}}


@pytest.mark.exhaustive(reason="bench_overlap's quick mode (overlap's behaviour: the rest of test_overlap.py)")
def test_bench_overlap_quick_mode_reports_both_settings():
  """experiments/bench_overlap.py --quick: 2 processes, τ = 0 and 1, no bandwidth limit (seconds)."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("bench_overlap", os.path.join(repo, "experiments", "bench_overlap.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  result = bench.main(["--quick"])
  runs = result["runs"]
  assert [r["overlap_steps"] for r in runs] == [0, 1]
  assert runs[0]["bytes_sent_per_replica"] == runs[1]["bytes_sent_per_replica"] > 0  # same bytes per round
  for run in runs:
    assert len(run["round_s"]) == 2 and all(0 <= f <= 1 for f in run["idle_fraction"])
