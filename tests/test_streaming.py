"""Fragment streaming (outer.streaming.*, outer/streaming.py, training/rounds/streaming.py): the streamed run
against a NumPy reference of the fragment-by-fragment schedule (lock-step and overlapped, plain and
compressed messages, shared and own partners), mesh = one device, the fragments a partition, the peak
bytes per step ÷ F in the compiled collectives, the pairing's law, bad input, and exact resume."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.config.outer import OuterConfig
from noloco_jax.inner.state import TrainState
from noloco_jax.outer import methods as outer_lib
from noloco_jax.outer import pairing
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import streaming
from noloco_jax.outer import wire
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.training import build as build_lib
from noloco_jax.training import loop as train
from noloco_jax.training.rounds import StreamingRounds
from test_compression import assert_one_line_config_error
from test_overlap import drive, np_sent  # pylint: disable=g-bad-import-order

N = 8
SHAPES = {"w": (6, 5), "b": (3,)}  # 33 values: tree order b, w
ALPHA, BETA, GAMMA = 0.5, 0.7, 0.9
CODECS = {
    "none": {}, "bfloat16": dict(message_dtype="bfloat16"), "int8": dict(compression="int8", chunk=16),
    "topk": dict(compression="topk", chunk=16, topk_density=0.25, topk_bits=4, slow_codec="int8"),
}


def _outer(F, H, tau, codec, partners="shared", split="slices"):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kind="noloco", inner_steps=H, rule=dict(outer_momentum=ALPHA, outer_lr=BETA, consensus_weight=GAMMA),
             codec=CODECS[codec], overlap=dict(steps=tau, mix=0.5),
             streaming=dict(fragments=F, split=split, partners=partners))
  return cfg


def _problem(seed):
  rng = np.random.default_rng(seed)
  targets = {k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()}
  theta0 = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in targets.items()}  # the replicas start equal
  return theta0, {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in targets.items()}


def _np_codec(codec):
  if codec == "bfloat16":
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    return lambda c, fresh, slow, e: (c.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64), e)
  if codec == "none":
    return lambda c, fresh, slow, e: (c, e)
  f = CODECS[codec]
  spec = (f["compression"], 1.0, f["chunk"], f.get("topk_density", 1.0), f.get("topk_bits", 8))
  return lambda c, fresh, slow, e: np_sent(c, fresh, slow, e, spec)


def np_streamed_run(theta0, targets, schedule, *, F, steps, H, tau, lr, mix, codec, partners):
  """Every replica takes SGD steps on ½‖θ − a_i‖². The values of all leaves end to end (tree order b, w) are
  cut into F equal ranges. At step t = b·H/F fragment f = b mod F sends, for its values only, c = βθ + (γ−β)φ
  through the codec (its chunks: each leaf's part of the range, on its own); its group (the schedule's
  grouping of index j, fragment f's own round count, or of b − 1 with own partners) forms the mean, merged
  after step t + τ: φ, δ by the NoLoCo rule and θ ← λθ + (1 − λ)φ (θ ← φ with τ = 0), on those values alone."""
  send = _np_codec(codec)
  keys = sorted(SHAPES)
  flat = lambda t: {k: t[k].reshape(N, -1).astype(np.float64) for k in keys}
  theta, phi = flat(theta0), flat(theta0)
  delta = {k: np.zeros_like(v) for k, v in theta.items()}
  residual = {k: np.zeros_like(v) for k, v in theta.items()}
  a = flat(targets)
  sizes = [theta[k].shape[1] for k in keys]
  starts = np.cumsum([0] + sizes)
  bounds = [sum(sizes) * f // F for f in range(F + 1)]
  parts = lambda f: [(k, max(bounds[f], s) - s, min(bounds[f + 1], s + n) - s) for k, s, n in zip(keys, starts, sizes)
                     if max(bounds[f], s) < min(bounds[f + 1], s + n)]
  done = [0] * F  # rounds of each fragment so far
  in_flight = None
  for step in range(1, steps + 1):
    theta = {k: theta[k] - lr * (theta[k] - a[k]) for k in keys}
    if step % (H // F) == 0:
      b = step // (H // F)
      f = b % F
      groups = schedule.groups(b - 1 if partners == "own" else done[f])
      done[f] += 1
      mean = {}
      for k, lo, hi in parts(f):
        c = BETA * theta[k][:, lo:hi] + (GAMMA - BETA) * phi[k][:, lo:hi]
        sent = np.empty_like(c)
        for j in range(N):
          sent[j], residual[k][j, lo:hi] = send(c[j], BETA * (theta[k][j, lo:hi] - phi[k][j, lo:hi]),
                                                GAMMA * phi[k][j, lo:hi], residual[k][j, lo:hi])
        mean[k, lo, hi] = np.empty_like(c)
        for group in groups:
          for i in group:
            mean[k, lo, hi][i] = (c[i] + sum(sent[j] for j in group if j != i)) / len(group)
      in_flight, sent_at = mean, step
    if in_flight is not None and (step == sent_at + tau or step == steps):
      for (k, lo, hi), m in in_flight.items():
        delta[k][:, lo:hi] = ALPHA * delta[k][:, lo:hi] + m - GAMMA * phi[k][:, lo:hi]
        phi[k][:, lo:hi] = phi[k][:, lo:hi] + delta[k][:, lo:hi]
        theta[k][:, lo:hi] = (mix * theta[k][:, lo:hi] + (1 - mix) * phi[k][:, lo:hi]) if tau else phi[k][:, lo:hi]
      in_flight = None
  back = lambda t: {k: t[k].reshape((N,) + SHAPES[k]) for k in keys}
  return back(theta), back(phi), back(delta), back(residual)


def _toy_run(outer, num_devices, theta0, targets, *, steps, lr):
  """The streaming round driver's run (test_overlap.drive)."""
  o = OuterConfig.parse(outer)
  method = outer_lib.make(outer)
  mesh = mesh_lib.make_mesh(N, num_devices)
  base = pairing.PairingSchedule(seed=4, num_replicas=N, group_size=2, mode="fresh")
  s = o.streaming
  fragments = streaming.cut(jax.tree.map(lambda x: x[0], theta0), None, fragments=s.fragments, split=s.split)
  driver = StreamingRounds(method, fragments, mesh, streaming.Pairing(base, fragments=s.fragments, partners=s.partners),
                           None, inner_steps=o.inner_steps, tau=o.overlap.steps, mix=o.overlap.mix, last_step=steps,
                           traffic=[wire.NOTHING] * s.fragments)
  run = drive(driver, method, mesh, theta0, targets, steps=steps, lr=lr)
  assert not driver.sent_at and run.loop.round == steps // (o.inner_steps // s.fragments)
  return jax.tree.map(np.asarray, run.state), base


_MORE = pytest.mark.exhaustive(reason="more codec and schedule cases (the default run keeps lock-step int8 with own "
                               "partners, overlapped float32 with own, overlapped top-k with shared)")


@pytest.mark.parametrize("F,H,tau,steps,codec,partners", [
    pytest.param(3, 6, 0, 14, "none", "shared", marks=_MORE), (3, 6, 1, 13, "none", "own"),
    (2, 4, 0, 11, "int8", "own"), (3, 6, 1, 14, "topk", "shared"),
    pytest.param(2, 4, 1, 9, "bfloat16", "shared", marks=_MORE)])
def test_streamed_rounds_match_the_numpy_fragment_schedule_and_mesh_equals_one_device(F, H, tau, steps, codec, partners):
  lr = 0.3
  theta0, targets = _problem(0)
  outer = _outer(F, H, tau, codec, partners)
  got = {d: _toy_run(outer, d, theta0, targets, steps=steps, lr=lr) for d in (N, 1)}
  state, schedule = got[N]
  theta, phi, delta, residual = np_streamed_run(theta0, targets, schedule, F=F, steps=steps, H=H, tau=tau, lr=lr,
                                                mix=0.5, codec=codec, partners=partners)
  for k in SHAPES:
    np.testing.assert_allclose(state.params[k], theta[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(state.outer["slow"][k], phi[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(state.outer["momentum"][k], delta[k], rtol=1e-5, atol=2e-5)
    if "residual" in state.outer:
      np.testing.assert_allclose(state.outer["residual"][k], residual[k], rtol=1e-5, atol=2e-5)
  # The mesh (ppermutes) and one device (gathers): bitwise with plain messages; a quantiser's extreme value
  # rounds by an ulp of its chunk's scale between the two programs (test_overlap.py says why).
  for a, b in zip(jax.tree.leaves(got[N][0]), jax.tree.leaves(got[1][0])):
    if codec in ("none", "bfloat16"):
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())))
  assert np.std(state.params["w"], axis=0).max() > 1e-3  # the replicas moved apart: not a trivial run


@pytest.mark.parametrize("codec", ["none", pytest.param("int8", marks=pytest.mark.exhaustive(
    reason="int8 (within an ulp; the float32 case, bitwise, stays in)"))])
def test_one_fragment_is_the_unstreamed_round_bitwise(codec):
  """F = 1 through the streaming machinery (which the config never builds for F = 1: the unstreamed drivers run)
  is the lock-step round."""
  from noloco_jax.training.rounds import LockstepRounds  # pylint: disable=g-import-not-at-top
  theta0, targets = _problem(1)
  streamed, schedule = _toy_run(_outer(1, 3, 0, codec), N, theta0, targets, steps=10, lr=0.3)
  method = outer_lib.make(_outer(1, 3, 0, codec))
  mesh = mesh_lib.make_mesh(N, N)
  driver = LockstepRounds(programs_lib.RoundPrograms(method, mesh, schedule), 3, wire.NOTHING, last_step=10)
  run = drive(driver, method, mesh, theta0, targets, steps=10, lr=0.3)
  # Bitwise with plain messages. int8's program is compiled for the fragment's flattened leaves, the
  # unstreamed one for the leaves' own shapes, and XLA rounds a chunk's extreme value (255 · (M / 255))
  # differently in the two (as between the mesh and one device, test_overlap.py): an ulp of the chunk's scale.
  for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(run.state)):
    if codec == "none":
      np.testing.assert_array_equal(a, np.asarray(b))
    else:
      np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())))


# ---- The fragments: a partition of the message; their bytes, counted and compiled ----


@pytest.mark.parametrize("split,F", [("slices", 2), ("slices", 5), pytest.param("slices", 7, marks=pytest.mark.exhaustive(
    reason="F = 7 (F = 2 and 5 stay in)")), ("layers", 2), ("layers", 4)])
def test_the_fragments_partition_every_value_once(split, F):
  params = {"embed": np.zeros((10, 4)), "layers": {"k": np.zeros((4, 3, 5)), "n": np.zeros((4, 3))},
            "head": np.zeros((4, 10))}
  roles = {"embed": "first", "layers": "layers", "head": "last"}
  leaf_roles = [roles[path[0].key] for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  fragments = streaming.cut(params, leaf_roles, fragments=F, split=split)
  zeros = jax.tree.map(lambda x: jnp.zeros((1,) + x.shape, jnp.int32), params)  # a stack of one replica
  counts = zeros
  for fragment in fragments:  # each fragment's values marked once
    ones = [jnp.ones(x.shape, jnp.int32) for x in streaming.take(zeros, fragment)]
    counts = jax.tree.map(jnp.add, counts, streaming.put(zeros, fragment, ones))
  for c in jax.tree.leaves(counts):
    np.testing.assert_array_equal(c, 1)
  sizes = [sum(int(np.prod(s.shape)) for s in streaming.take_shapes(params, fr)) for fr in fragments]
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  if split == "slices":  # equal ranges: the peak is the whole ÷ F
    assert max(sizes) == -(-total // F) and min(sizes) == total // F
  else:  # a block of layers each, the embedding first, the head last
    assert sizes[0] == 40 + (15 + 3) * 4 // F and sizes[-1] == 40 + (15 + 3) * 4 // F


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_peak_bytes_per_step_are_the_whole_rounds_over_F_in_the_compiled_collectives(codec):
  """Each fragment's compiled round moves exactly its counted bytes; together the whole round's (float32),
  the largest ≤ ⌈whole / F⌉ (float32) or the whole's / F plus the split leaves' extra chunk scales (int8)."""
  F = 4
  params = {"w": np.zeros((N, 96, 128), np.float32), "b": np.zeros((N, 5), np.float32)}
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
  fragments = streaming.cut(one, None, fragments=F, split="slices")
  method = outer_lib.make(_outer(F, 8, 0, codec))
  whole = outer_lib.make(_outer(1, 8, 0, codec))
  mesh = mesh_lib.make_mesh(N, N)
  schedule = pairing.PairingSchedule(seed=0, num_replicas=N, group_size=2, mode="fresh")
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=params, opt_state=(),
                                    outer=method.init(params)), mesh_lib.replica_sharding(mesh))
  compiled, counted = [], []
  for fragment in fragments:
    m = streaming.fragment_method(method, fragment)
    programs = programs_lib.RoundPrograms(m, mesh, schedule)
    hlo = programs.compile(state, 0)
    compiled.append(hlo_lib.collective_bytes(hlo["routes"].as_text(), "collective-permute"))
    assert hlo_lib.all_collective_bytes(hlo["message"].as_text()) == {} == hlo_lib.all_collective_bytes(
        hlo["merge"].as_text())  # only the routes communicate
    counted.append(m.traffic(one, N)[0].operand)
  assert compiled == counted
  total = whole.traffic(one, N)[0].operand
  if codec == "none":
    assert sum(counted) == total == (96 * 128 + 5) * 4 and max(counted) <= -(-total // F // 4) * 4
  else:  # each fragment's split leaf carries one more chunk scale (4 bytes) and its chunk's rounding to 8 values
    assert total / F <= max(counted) <= total / F + 2 * (4 + 8)


# ---- Who pairs with whom ----


def test_shared_partners_are_the_unstreamed_rounds_and_own_partners_are_fresh_uniform_draws():
  base = pairing.PairingSchedule(seed=7, num_replicas=N, group_size=2, mode="fresh")
  F = 4
  shared = streaming.Pairing(base, fragments=F, partners="shared")
  own = streaming.Pairing(base, fragments=F, partners="own")
  # Shared: fragment f's j-th round pairs as round j; the boundaries b = 1, 2, ... run fragments 1, 2, 3, 0, 1, ...
  for q in range(40):
    f, j = streaming.boundary_fragment(q + 1, F)
    assert f == (q + 1) % F and shared.groups(q) == base.groups(j) and shared.of_fragment(f).groups(j) == base.groups(j)
    assert own.of_fragment(f).groups(j) == own.groups(q) == base.groups(q)
  # Own: replica 0's partner in each fragment round is uniform over the other 7, and independent of its partner
  # in the next fragment's round (chi-square; 7 × 7 table of consecutive partners).
  R = 7000
  partner = np.array([next(g for g in own.groups(q) if 0 in g) for q in range(R)])
  partner = np.where(partner[:, 0] == 0, partner[:, 1], partner[:, 0])
  counts = np.bincount(partner, minlength=N)[1:]
  assert stats.chisquare(counts).pvalue > 1e-3, counts
  table = np.zeros((N - 1, N - 1))
  for a, b in zip(partner[:-1], partner[1:]):
    table[a - 1, b - 1] += 1
  assert stats.chi2_contingency(table).pvalue > 1e-3
  assert abs(np.mean(partner[:-1] == partner[1:]) - 1 / (N - 1)) < 4 * np.sqrt((1 / 7) * (6 / 7) / R)


def test_fragment_rounds_are_counted_from_the_step():
  F = 5
  for B in range(0, 40):
    for f in range(F):
      assert streaming.rounds_done(f, B, F) == sum(1 for b in range(1, B + 1) if b % F == f)
  assert [streaming.boundary_fragment(b, 3) for b in range(1, 8)] == [(1, 0), (2, 0), (0, 0), (1, 1), (2, 1), (0, 1),
                                                                       (1, 2)]


# ---- Bad input: one line naming the field ----


@pytest.mark.parametrize("overrides,field", [  # smoke: H = 3
    ({"outer.streaming.fragments": 2}, "outer.streaming.fragments"),  # does not divide H
    ({"outer.streaming.fragments": 0}, "outer.streaming.fragments"),
    ({"outer.streaming.split": "rows"}, "outer.streaming.split"),
    ({"outer.streaming.partners": "any"}, "outer.streaming.partners"),
    ({"outer.inner_steps": 6, "outer.streaming.fragments": 3, "outer.overlap.steps": 2}, "outer.overlap.steps"),
    ({"outer.streaming.fragments": 3, "outer.kind": "diloco"}, "outer.streaming.fragments"),
    ({"outer.streaming.fragments": 3, "outer.codec.compression": "coset"}, "outer.streaming.fragments"),
    ({"outer.streaming.fragments": 3, "outer.schedule": "async", "num_replicas": 2}, "outer.streaming.partners"),
])
def test_bad_streaming_settings_name_the_field(overrides, field):
  assert_one_line_config_error(overrides, field)


def test_more_fragments_than_the_model_has_layers_names_the_field():
  config = default.get_config("smoke")  # one layer
  config.outer.streaming.update(fragments=3, split="layers")
  with pytest.raises(config_lib.ConfigError) as info:
    build_lib.build(config_lib.load(config))
  message = str(info.value)
  assert message.startswith("config.outer.streaming.fragments=3 ") and "at most 1" in message and "\n" not in message


# ---- End to end: the model streamed by layers, overlapped; stopped inside a window, resumed bitwise ----


def test_streamed_training_resumes_bitwise_from_inside_a_window(tmp_path, compile_cache):
  del compile_cache
  config = default.get_config("smoke")
  # H = 4, F = 2 by layers (2 layers), τ = 1: fragment 1 sent at 2, 6, fragment 0 at 4, 8; each merged a step
  # later. Saved at 6: fragment 1's exchange in flight.
  config.model.num_layers = 2
  config.num_steps, config.checkpoint_every, config.checkpoint.keep, config.eval_every = 8, 6, 3, 4
  config.outer.inner_steps = 4
  config.outer.overlap.update(steps=1, mix=0.5)
  config.outer.streaming.update(fragments=2, split="layers", partners="own")
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  assert 0 < first["eval/loss"] < np.log(257)
  meta = json.load(open(os.path.join(workdir, "checkpoints", "6", "meta", "metadata")))
  assert meta["driver"] == {"sent_at": 6} and meta["round"] == 3
  rows = [json.loads(line) for line in open(os.path.join(workdir, "pairings.jsonl"))]
  assert [r["round"] for r in rows] == [0, 1, 2, 3] and [r["step"] for r in rows] == [2, 4, 6, 8]
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  second = train.train_and_evaluate(config, workdir)
  for a, b in zip(jax.tree.leaves(first["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Bytes: 4 fragment rounds, each its fragment's (the embedding with layer 0, layer 1 with the head).
  assert first["comm/collective_operand_bytes_per_replica"] == second["comm/collective_operand_bytes_per_replica"]
  whole = 4 * sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(first["state"].params))
  assert first["comm/collective_operand_bytes_per_replica"] == 2 * whole


def test_bench_compression_prints_each_fragments_bytes_and_the_peak():
  """experiments/bench_compression.py's bytes part (no training): a streamed setting sends the float32 round's
  bytes in F fragments whose largest is a fifth of it (F = 5); int8's fragments each carry their own chunks."""
  from experiments import bench_compression as bench  # pylint: disable=g-import-not-at-top
  rows = {r["setting"]: r for r in bench.message_bytes("", hlo=False)}
  whole, streamed = rows["float32"], rows["float32 F=5"]
  assert streamed["bytes_per_round"] == whole["bytes_per_round"] == sum(streamed["fragment_bytes"])
  assert len(streamed["fragment_bytes"]) == 5 and streamed["peak_bytes_per_step"] == -(-whole["params"] // 5) * 4
  assert rows["float32 F=2"]["peak_bytes_per_step"] == whole["bytes_per_round"] // 2
  int8 = rows["int8 F=5"]
  assert rows["int8"]["bytes_per_round"] <= int8["bytes_per_round"] < 1.1 * rows["int8"]["bytes_per_round"]
  assert int8["peak_bytes_per_step"] == max(int8["fragment_bytes"]) < 0.25 * rows["int8"]["bytes_per_round"]
