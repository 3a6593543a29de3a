"""Every codec in every schedule (issue 36.1): bfloat16 messages, int8, int4 and top-k with error feedback,
run by the lock-step, overlapped and asynchronous round drivers on a toy problem, each against one NumPy
reference of the whole run; in the asynchronous schedule the residual commits only when the exchange
completes, and the bytes counted are the transport's.

The toy: every replica takes SGD steps on ½‖θ − a_i‖² (no model: each run compiles a few small programs).
The asynchronous runs are two drivers (training/rounds/asynchronous.AsyncRounds, one per replica, each on
its own thread as each on its own process) whose session is an in-memory exchange: at equal speed every
round pairs them at equal progress, so the run is the lock-step run's.
"""

import os
import threading

import jax
import numpy as np
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.asynchronous import job as job_lib
from noloco_jax.asynchronous import session as session_lib
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import wire
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.outer import streaming
from noloco_jax.training.rounds import LockstepRounds, OverlappedRounds, StreamingRounds
from noloco_jax.training.rounds.asynchronous import AsyncRounds
from test_overlap import _ToyRun, drive, np_overlapped_run, np_sent  # pylint: disable=g-bad-import-order

N = 2  # the asynchronous schedule pairs two processes: every round's group is (0, 1) in every schedule
SHAPES = {"w": (6, 5), "b": (3,)}
H, STEPS, LR = 3, 10, 0.3
ALPHA, BETA, GAMMA = 0.5, 0.7, 0.9
CODECS = {
    "bfloat16": dict(message_dtype="bfloat16"),
    "int8": dict(compression="int8", chunk=16),
    "int4": dict(compression="int4", chunk=16),
    "topk": dict(compression="topk", chunk=16, topk_density=0.25, topk_bits=4, slow_codec="int8"),
}
SCHEDULES = ("lockstep", "overlapped", "async")


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  targets = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
  theta0 = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in targets.items()}  # the replicas start equal
  return theta0, {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in targets.items()}


def _config(codec: str, schedule: str, tau: int = 0, fragments: int = 1):
  cfg = default.get_config("smoke")
  cfg.num_replicas, cfg.num_steps = N, STEPS
  cfg.outer.update(kind="noloco", inner_steps=H, schedule="async" if schedule == "async" else "lockstep",
                   rule=dict(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA, group_size=2),
                   codec=CODECS[codec], overlap=dict(steps=tau, mix=0.5))
  if fragments > 1:  # the asynchronous schedule's fragment rounds find their own partners
    cfg.outer.streaming.update(fragments=fragments, partners="own")
  return config_lib.load(cfg)


def _fragments(config):
  """outer/streaming.cut's fragments of the toy's parameters (None: no streaming)."""
  s = config.outer.streaming
  if s.fragments == 1:
    return None
  one = {k: jax.ShapeDtypeStruct(shape, np.float32) for k, shape in SHAPES.items()}
  return streaming.cut(one, None, fragments=s.fragments, split=s.split)


def np_sent_with(codec: str):
  """np_sent (test_overlap.py) for the codec, bfloat16 included: what a message becomes on the wire."""
  if codec == "bfloat16":
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    return lambda c, fresh, slow, residual: (c.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64),
                                              residual)
  f = CODECS[codec]
  spec = (f["compression"], 1.0, f["chunk"], f.get("topk_density", 1.0), f.get("topk_bits", 8))
  return lambda c, fresh, slow, residual: np_sent(c, fresh, slow, residual, spec)


# ---- The drivers, as the training loop calls them ----


def _inner(lr):
  return jax.jit(lambda s, a: s.replace(params=jax.tree.map(lambda t, x: t - lr * (t - x), s.params, a)),
                 donate_argnums=0)


def _loop(driver, run, targets, steps, first=1):
  inner = _inner(LR)
  for step in range(first, steps + 1):
    driver.before_step(run, step)
    run.state = inner(run.state, targets)
    driver.after_step(run, step, {})


def _lockstep_run(config, theta0, targets, tau):
  method = outer_lib.make(config.outer)
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  if fragments := _fragments(config):
    driver = StreamingRounds(method, fragments, mesh, streaming.Pairing(schedule, fragments=len(fragments),
                                                                        partners="own"), None, inner_steps=H,
                             tau=tau, mix=0.5, last_step=STEPS, traffic=[wire.NOTHING] * len(fragments))
  elif tau:
    driver = OverlappedRounds(method, mesh, schedule, None, inner_steps=H, tau=tau, mix=0.5, last_step=STEPS,
                              traffic=wire.NOTHING, threaded=False)
  else:
    driver = LockstepRounds(programs_lib.RoundPrograms(method, mesh, schedule), H, wire.NOTHING, last_step=STEPS)
  run = drive(driver, method, mesh, theta0, targets, steps=STEPS, lr=LR)
  return jax.tree.map(np.asarray, run.state), run.loop


class _Pair:
  """The transport of two in-memory processes: `Session.round`'s answer for each, once both have sent.
  `lose`: the rounds (0-based) whose partner is lost mid-exchange: both are told the exchange failed."""

  def __init__(self, lose=()):
    self.lose, self._barrier, self._sent = set(lose), threading.Barrier(2, timeout=120), {}
    self.fragments = {0: [], 1: []}  # each slot's rounds' fragments, in order

  def session(self, slot):
    pair = self

    class Session:
      step, round_ = 0, 0

      def round(self, message, progress, step=None, fragment=0):
        del step
        pair.fragments[slot].append(fragment)
        pair._sent[slot] = (message, progress)
        pair._barrier.wait()  # both have offered
        (theirs, their_progress), r = pair._sent[1 - slot], self.round_
        pair._barrier.wait()  # both have read before either offers again
        self.round_ += 1
        nbytes = sum(x.nbytes for x in jax.tree.leaves(message))
        if r in pair.lose:
          return session_lib.RoundResult("failed", r, (0, 1), (0, 0), reason="partner lost mid-exchange",
                                         bytes_sent=nbytes)
        return session_lib.RoundResult("exchanged", r, (0, 1), (0, 0), [message, theirs], [progress, their_progress],
                                       bytes_sent=nbytes, bytes_received=sum(x.nbytes for x in jax.tree.leaves(theirs)))

      def join_requests(self):
        return {}

      def serve_joins(self, state_fn, progress, requests=None):
        del state_fn, progress, requests
        return 0

      def close(self, **kwargs):
        del kwargs

    return Session()


class _Slot:
  def __init__(self, slot):
    self.slot, self.rejoining = slot, False


def _async_drivers(config, theta0, pair, steps, resume):
  """Two asynchronous drivers, one replica each (a process's config: job.process_config): their runs, the
  drivers, and `train(slot, targets)`, which runs one over `steps` (first, last) on a thread of its own."""
  local = job_lib.process_config(config)
  method = outer_lib.make(local.outer)
  mesh, fragments = mesh_lib.make_mesh(1, 1), _fragments(local)
  runs, drivers, errors = [], [], []
  for slot in range(N):
    if resume is None:
      params = {k: v[slot:slot + 1] for k, v in theta0.items()}
      state, record = TrainState(step=np.zeros(1, np.int32), params=params, opt_state=(), outer=method.init(params)), {}
    else:
      state, record = jax.tree.map(lambda x: x[slot:slot + 1], resume[0]), resume[1][slot]
    run = _ToyRun(jax.device_put(state, jax.devices()[0]))
    driver = AsyncRounds(method, mesh, None, fragments, local.outer, seed=local.seed, last_step=local.num_steps,
                         process=_Slot(slot))
    driver.restore(record)
    # What `start` does: a fresh run's record, the session, every program compiled.
    driver._record = driver._record or {"progress": 0.0, "progress_step": 0}  # pylint: disable=protected-access
    driver.session = pair.session(slot)
    driver._compile_ahead(run.state)  # pylint: disable=protected-access
    runs.append(run)
    drivers.append(driver)

  def train(slot, targets):
    try:
      _loop(drivers[slot], runs[slot], targets, steps[1], steps[0])
    except Exception as e:  # pylint: disable=broad-except  (re-raised on the test's thread)
      errors.append(e)
      pair._barrier.abort()  # pylint: disable=protected-access
  return runs, drivers, train, errors


def _async_run(config, theta0, targets, pair=None, *, steps=(1, STEPS), resume=None):
  """The two processes' run over `steps`: (their states stacked, their loop records, their drivers).
  `resume`: (stacked state, driver records) to go on from, what each process's checkpoint holds."""
  pair = pair or _Pair()
  runs, drivers, train, errors = _async_drivers(config, theta0, pair, steps, resume)
  threads = [threading.Thread(target=train, args=(slot, {k: v[slot:slot + 1] for k, v in targets.items()}))
             for slot in range(N)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  for d in drivers:
    d.close(failed=bool(errors))
  if errors:
    raise errors[0]
  states = [jax.tree.map(np.asarray, r.state) for r in runs]
  return jax.tree.map(lambda *x: np.concatenate(x), *states), [r.loop for r in runs], drivers


# ---- Each codec in each schedule against NumPy ----


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("codec", CODECS)
def test_codec_in_schedule_matches_numpy(codec, schedule):
  """The whole run (3 rounds, 10 steps) against np_overlapped_run with the codec's message on the wire and its
  error-feedback residual updated at every completed exchange. Overlapped: τ = 2, λ = 0.5; lock-step and
  asynchronous: τ = 0 (θ ← φ)."""
  tau = 2 if schedule == "overlapped" else 0
  config = _config(codec, schedule, tau)
  theta0, targets = _problem()
  if schedule == "async":
    got, loops, _ = _async_run(config, theta0, targets)
    assert [loop.round for loop in loops] == [STEPS // H] * N
  else:
    got, loop = _lockstep_run(config, theta0, targets, tau)
    assert loop.round == STEPS // H
  schedule_np = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  theta, phi, delta = np_overlapped_run(theta0, targets, schedule_np, steps=STEPS, H=H, tau=tau, lr=LR, alpha=ALPHA,
                                        beta=BETA, gamma=GAMMA, mix=0.5 if tau else 0.0, codec=None,
                                        send=np_sent_with(codec))
  for k in SHAPES:
    np.testing.assert_allclose(got.params[k], theta[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got.outer["slow"][k], phi[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got.outer["momentum"][k], delta[k], rtol=1e-5, atol=2e-5)
  assert ("residual" in got.outer) == (codec != "bfloat16")
  assert np.std(got.params["w"], axis=0).max() > 1e-3  # the replicas moved apart: not a trivial run


# The test suite compiles with XLA's backend optimisation at level 0 (scripts/test.sh: quicker compiles).
# There, the int8 and top-k runs of the two schedules (a mesh program per round and a one-device program
# per process) differ in a few elements by float32 round-off (measured: at most 1.2e-7 on values of
# order 1, from the quantiser's scale); at XLA's default level, which every run uses, they agree bit for
# bit (measured: NOLOCO_TEST_XLA_OPT_LEVEL=3 bash scripts/test.sh tests/test_codec_schedules.py -k bit_for_bit).
LEVEL_0 = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")


def assert_bitwise(got, want, codec: str) -> None:
  """Two pytrees equal bit for bit, leaf by leaf (a failure names the leaf); see LEVEL_0."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(got)[0])
  for path, a, b in zip(paths, leaves, jax.tree.leaves(want), strict=True):
    if LEVEL_0 and codec in ("int8", "topk"):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2.5e-7, err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("codec", CODECS)
def test_async_run_at_equal_progress_is_the_lockstep_run_bit_for_bit(codec):
  """Two processes at equal speed (each round pairs them at equal progress) end where the lock-step run on
  two devices (one replica each) ends, every leaf bit for bit: θ, φ, δ and the codec's residual."""
  theta0, targets = _problem(1)
  got, _, _ = _async_run(_config(codec, "async"), theta0, targets)
  want, _ = _lockstep_run(_config(codec, "lockstep"), theta0, targets, 0)
  assert_bitwise((got.params, got.outer), (want.params, want.outer), codec)


@pytest.mark.parametrize("codec", ["bfloat16", "topk"])
def test_async_streamed_run_at_equal_progress_is_the_lockstep_streamed_run_bit_for_bit(codec):
  """Fragment streaming (F = 3, H = 3: one fragment's round every step, fragment f at the steps ≡ f mod 3) in
  the asynchronous schedule: two processes at equal speed, each fragment round matched on its own, end where
  the lock-step streamed run (training/rounds/streaming.StreamingRounds) ends, every leaf bit for bit: θ, φ,
  δ and each fragment's part of the codec's residual. Every round is the fragment the lock-step schedule
  runs at that step, and both runs moved every fragment."""
  theta0, targets = _problem(5)
  pair = _Pair()
  got, loops, _ = _async_run(_config(codec, "async", fragments=3), theta0, targets, pair)
  want, loop = _lockstep_run(_config(codec, "lockstep", fragments=3), theta0, targets, 0)
  assert [loop.round for loop in loops] == [loop.round] * N == [STEPS] * N  # a fragment round every step
  order = [streaming.boundary_fragment(step, 3)[0] for step in range(1, STEPS + 1)]
  assert pair.fragments == {0: order, 1: order} and order[:3] == [1, 2, 0]
  assert_bitwise((got.params, got.outer), (want.params, want.outer), codec)
  # Not a run in which streaming changed nothing: the unstreamed lock-step run ends elsewhere.
  whole, _ = _lockstep_run(_config(codec, "lockstep"), theta0, targets, 0)
  assert np.abs(whole.outer["slow"]["w"] - want.outer["slow"]["w"]).max() > 1e-4


# ---- The asynchronous schedule: the residual is the process's own, commits with the exchange; bytes ----


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_async_run_resumed_from_its_state_and_record_is_the_whole_run_bit_for_bit(codec):
  """Stopped after step 6 (two rounds) and resumed from what each process's checkpoint holds (its state,
  the codec's residual in it, and its driver's record), the run ends bit for bit where the whole run ends:
  nothing of the codec lives outside the state."""
  config = _config(codec, "async")
  theta0, targets = _problem(4)
  whole, _, _ = _async_run(config, theta0, targets)
  first, _, drivers = _async_run(config, theta0, targets, steps=(1, 6))
  assert all(np.abs(r).max() > 0 for r in jax.tree.leaves(first.outer["residual"]))  # a residual to carry over
  again, _, _ = _async_run(config, None, targets, steps=(7, STEPS), resume=(first, [d.save() for d in drivers]))
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(again)[0])
  for path, a, b in zip(paths, leaves, jax.tree.leaves(whole), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_partner_lost_mid_exchange_leaves_the_residual_as_it_was(codec):
  """Round 1 (of 3) fails for both (the partner lost mid-exchange): the run equals NumPy's run in which
  round 1 sent nothing: no merge and no residual update (the residual is what round 0 left)."""
  config = _config(codec, "async")
  theta0, targets = _problem(2)
  got, _, drivers = _async_run(config, theta0, targets, _Pair(lose={1}))
  for driver in drivers:
    assert driver.scalars()["async/failed_rounds"] == 1 and driver.scalars()["async/exchanged_rounds"] == 2
  schedule_np = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  theta, phi, delta, residual = np_overlapped_run(
      theta0, targets, schedule_np, steps=STEPS, H=H, tau=0, lr=LR, alpha=ALPHA, beta=BETA, gamma=GAMMA, mix=0.0,
      send=np_sent_with(codec), skip_rounds={1}, with_residual=True)
  for k in SHAPES:
    np.testing.assert_allclose(got.outer["residual"][k], residual[k], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(got.params[k], theta[k], rtol=1e-5, atol=2e-5)
  # The reference is not blind to the commit: had round 1 updated the residual, it would differ.
  _, _, _, committed = np_overlapped_run(
      theta0, targets, schedule_np, steps=STEPS, H=H, tau=0, lr=LR, alpha=ALPHA, beta=BETA, gamma=GAMMA, mix=0.0,
      send=np_sent_with(codec), skip_rounds={1}, with_residual=True, commit_skipped=True)
  assert max(np.abs(committed[k] - residual[k]).max() for k in SHAPES) > 1e-4


def test_async_bytes_are_the_transports_counts_per_exchange():
  """comm/bytes_sent_per_replica of an asynchronous run is what its exchanges sent (the session's counts),
  as a lock-step run counts its rounds: int8 sends about a quarter of float32's bytes (scales, padding)."""
  theta0, targets = _problem(3)
  sent = {}
  for codec in ("int8", "float32"):
    config = _config("int8", "async") if codec == "int8" else config_lib.load(_float32_cfg())
    _, loops, _ = _async_run(config, theta0, targets)
    sent[codec] = [loop.bytes_sent for loop in loops]
    assert [loop.bytes_received for loop in loops] == sent[codec]
  floats = sum(int(np.prod(s)) for s in SHAPES.values())
  assert sent["float32"] == [STEPS // H * 4 * floats] * N
  # int8: one byte per value of each chunk (padded to 8), one float32 scale per chunk (chunk 16).
  chunks = {k: -(-int(np.prod(s)) // 16) for k, s in SHAPES.items()}
  widths = {k: min(16, -(-int(np.prod(s)) // 8) * 8) for k, s in SHAPES.items()}
  per_round = sum(chunks[k] * widths[k] + 4 * chunks[k] for k in SHAPES)
  assert sent["int8"] == [STEPS // H * per_round] * N


def _float32_cfg():
  cfg = default.get_config("smoke")
  cfg.num_replicas, cfg.num_steps = N, STEPS
  cfg.outer.update(kind="noloco", inner_steps=H, schedule="async",
                   rule=dict(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA, group_size=2))
  return cfg


# ---- Bad input ----


@pytest.mark.parametrize("kind,field,value", [
    ("diloco", "outer.codec.compression", "int8"), ("epidemic_adam", "outer.codec.compression", "topk"),
    ("diloco", "outer.codec.message_dtype", "bfloat16"), ("ddp", "outer.codec.message_dtype", "bfloat16")])
def test_a_codec_the_method_cannot_carry_is_one_line_naming_the_field(kind, field, value):
  cfg = default.get_config("smoke")
  cfg.outer.kind = kind
  section, _, name = field.rpartition(".")
  cfg.outer.codec[name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg)
  message = str(e.value)
  assert message.startswith(f"config.{field}={value!r} is not valid") and "\n" not in message, message
  assert f"outer.kind={kind!r}" in message, message
