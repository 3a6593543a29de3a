"""Epidemic Learning (outer.kind=epidemic, both topologies): the graphs and their laws, the round against
NumPy, mesh = simulator, bytes in the compiled program, training and resume."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.outer.epidemic import ORACLE_MAX_DEGREE
from noloco_jax.outer import epidemic
from noloco_jax.outer import methods as outer_lib
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.tools import hlo as hlo_lib
from noloco_jax.outer import programs as programs_lib
from noloco_jax.inner.state import TrainState
import hlo_helpers  # pylint: disable=g-bad-import-order  (tests/hlo_helpers.py)

N = 8


def _method(fanout, message_dtype="float32", topology="oracle"):
  cfg = ml_collections.ConfigDict(default.get_config().outer)
  cfg.update(kind="epidemic", rule=dict(fanout=fanout, topology=topology), codec=dict(message_dtype=message_dtype))
  return outer_lib.make(cfg)


def _round(method, pool, index, theta, num_devices=N):
  mesh = mesh_lib.make_mesh(N, num_devices)
  state = TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer={"slow": theta})
  state = jax.device_put(state, mesh_lib.replica_sharding(mesh))
  new, _ = programs_lib.make_round_fn(method, mesh, pool)(state, jnp.int32(index))
  return jax.tree.map(np.asarray, new)


def np_epidemic(theta, targets):
  """Reference from the definition: own model plus every model sent to me, plain average (float64)."""
  out = {}
  for k, x in theta.items():
    total, count = x.astype(np.float64).copy(), np.ones(N)
    for i in range(N):
      for t in targets[i]:
        total[t] += x[i]
        count[t] += 1
    out[k] = total / count.reshape((N,) + (1,) * (x.ndim - 1))
  return out


def _theta(seed):
  rng = np.random.default_rng(seed)
  return {"w": rng.normal(size=(N, 6, 5)).astype(np.float32), "b": rng.normal(size=(N, 3)).astype(np.float32)}


# ---- The graphs: structure, then their laws (seeded; a correct law passes p > 0.01 at least 99 times in 100) ----


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
@pytest.mark.parametrize("num_replicas,fanout", [(8, 1), (8, 3), (8, 5), (8, 7), (5, 2), (16, 3), (16, 13)])
def test_graphs_and_their_matchings(topology, num_replicas, fanout):
  """Every sender sends to s distinct others; the matchings are partial permutations covering every edge
  once, as few as the largest degree (König); EL-Oracle's are s permutations without fixed points."""
  n, s = num_replicas, fanout
  for draw in range(20):
    targets = epidemic.draw_targets(0, draw, n, s, topology)
    assert targets.shape == (n, s)
    assert all(len(set(row)) == s and i not in row for i, row in enumerate(targets))
    indegree = np.bincount(targets.ravel(), minlength=n)
    graph = epidemic.matchings(targets)
    edges = sorted((src, g) for m in graph for g, src in enumerate(m) if src >= 0)
    assert edges == sorted((i, int(t)) for i in range(n) for t in targets[i])
    for m in graph:
      senders = [x for x in m if x >= 0]
      assert len(senders) == len(set(senders))  # each sender at most once per ppermute
    assert len(graph) == max(s, indegree.max())
    if topology == "oracle":
      assert np.all(indegree == s)  # every replica receives from exactly s others
      assert len(graph) == s and all(sorted(m) == list(range(n)) and all(m[g] != g for g in range(n)) for m in graph)


def test_matchings_of_any_bipartite_graph_use_the_largest_degree():
  """The edge colouring against its bound on arbitrary (not only regular) graphs: Δ matchings."""
  rng = np.random.default_rng(7)
  for _ in range(200):
    n = int(rng.integers(2, 12))
    s = int(rng.integers(1, n))
    targets = np.stack([rng.choice([j for j in range(n) if j != i], s, replace=False) for i in range(n)])
    graph = epidemic.matchings(targets)
    assert len(graph) == max(s, np.bincount(targets.ravel(), minlength=n).max())
    edges = sorted((src, g) for m in graph for g, src in enumerate(m) if src >= 0)
    assert edges == sorted((i, int(t)) for i in range(n) for t in targets[i])


def regular_graphs(n: int, s: int) -> list[bytes]:
  """Every s-regular directed graph on n nodes without self-loops (adjacency bytes), by enumeration."""
  rows = [[c for c in itertools.combinations(range(n), s) if i not in c] for i in range(n)]
  found = []
  for choice in itertools.product(*rows):
    adjacency = np.zeros((n, n), bool)
    for i, c in enumerate(choice):
      adjacency[i, list(c)] = True
    if np.all(adjacency.sum(0) == s):
      found.append(adjacency.tobytes())
  return found


def _graph_key(targets: np.ndarray) -> bytes:
  adjacency = np.zeros((len(targets),) * 2, bool)
  np.put_along_axis(adjacency, targets, True, axis=1)
  return adjacency.tobytes()


def _law_over_graphs(draw, n: int, s: int, per_graph: int = 60):
  """(chi-square p-value, number of graphs): draws against the uniform law over all s-regular graphs."""
  graphs = regular_graphs(n, s)
  index = {g: i for i, g in enumerate(graphs)}
  counts = np.zeros(len(graphs), np.int64)
  for d in range(per_graph * len(graphs)):
    counts[index[_graph_key(draw(d))]] += 1  # a KeyError would be a graph that is not s-regular
  return stats.chisquare(counts).pvalue, len(graphs)


@pytest.mark.parametrize("num_replicas,fanout,count", [(5, 2, 216), (5, 1, 44), (5, 3, 44), (4, 2, 9)])
def test_oracle_is_uniform_over_all_regular_graphs(num_replicas, fanout, count):
  """EL-Oracle draws every s-regular graph equally often (one graph per draw: an exact chi-square over all
  of them). (5, 2) is the configuration model itself; (5, 3) and (4, 2) go through the complement."""
  p, graphs = _law_over_graphs(lambda d: epidemic.oracle_targets(3, d, num_replicas, fanout), num_replicas, fanout)
  assert graphs == count  # the enumeration itself, against the known counts of such 0-1 matrices
  assert p > 0.01, p


def test_the_uniformity_test_rejects_a_union_of_permutations():
  """The test above has the power to see the obvious sampler's bias: two uniform derangements, redrawn
  until they differ at every node, weigh a graph by its number of ordered splits into two permutations
  (2^cycles of the bipartite graph: 2 or 4 at N = 5), so the 216 graphs are not equally likely."""
  def union_of_permutations(d):
    rng = np.random.default_rng([99, d])
    while True:
      a, b = rng.permutation(5), rng.permutation(5)
      if np.all(a != np.arange(5)) and np.all(b != np.arange(5)) and np.all(a != b):
        return np.stack([a, b], axis=1)
  p, _ = _law_over_graphs(union_of_permutations, 5, 2, per_graph=20)
  assert p < 1e-6, p


def _subset_counts(targets_of, n: int, s: int, draws: int, sender: int = 0) -> np.ndarray:
  subsets = {c: i for i, c in enumerate(itertools.combinations([j for j in range(n) if j != sender], s))}
  counts = np.zeros(len(subsets), np.int64)
  for d in range(draws):
    counts[subsets[tuple(sorted(int(t) for t in targets_of(d)[sender]))]] += 1
  return counts


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
def test_a_senders_receivers_are_a_uniform_set_of_others(topology):
  """Both laws: sender 0's s receivers are uniform over the C(N−1, s) sets (for EL-Oracle by symmetry:
  relabelling the other replicas maps s-regular graphs onto s-regular graphs), N = 8, s = 3: 35 sets."""
  counts = _subset_counts(lambda d: epidemic.draw_targets(4, d, N, 3, topology), N, 3, draws=3500)
  assert stats.chisquare(counts).pvalue > 0.01


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
@pytest.mark.parametrize("fanout", [1, 2, 6])
def test_every_ordered_pair_is_an_edge_with_probability_s_over_n_minus_1(topology, fanout):
  """Each ordered pair (i, j ≠ i) is an edge in a draw with probability s/(N − 1), independently across
  draws: a binomial test per pair, Bonferroni over the 56 pairs (pairs within one draw are dependent:
  rows and, for EL-Oracle, columns sum to s, so one pooled chi-square over them would not be valid)."""
  s, draws = fanout, 2000
  counts = np.zeros((N, N), np.int64)
  for d in range(draws):
    targets = epidemic.draw_targets(6, d, N, s, topology)
    counts[np.repeat(np.arange(N), s), targets.ravel()] += 1
  assert np.all(np.diag(counts) == 0)
  p = s / (N - 1)
  pvalues = [stats.binomtest(int(c), draws, p).pvalue for c in counts[~np.eye(N, dtype=bool)]]
  assert min(pvalues) * len(pvalues) > 0.01, (min(pvalues), counts)


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_local_in_degree_is_binomial(fanout):
  """EL-Local: replica 0's in-degree over independent draws follows Binomial(N − 1, s/(N − 1)) (chi-square,
  bins with expectation < 5 merged); at s = 1 a third of the replicas receive nothing. The senders choose
  independently, which is what makes it binomial."""
  s, draws = fanout, 4000
  indegree = np.array([np.sum(epidemic.local_targets(8, d, N, s) == 0) for d in range(draws)])
  pmf = stats.binom.pmf(np.arange(N), N - 1, s / (N - 1))
  observed = np.bincount(indegree, minlength=N).astype(float)
  expected = pmf * draws
  keep = expected >= 5
  if not keep.all():
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
  assert stats.chisquare(observed, expected).pvalue > 0.01
  if s == 1:
    assert abs(np.mean(indegree == 0) - (6 / 7) ** 7) < 0.03  # ≈ 0.34


def test_oracle_acceptance_rate_at_the_largest_allowed_degree():
  """The exact draw rejects configuration-model tries; at min(s, N − 1 − s) = ORACLE_MAX_DEGREE = 3 the
  measured acceptance is ≥ 0.2 % (about exp(−5) = 0.67 % for large N), i.e. a few hundred vectorised tries
  a graph; at 4 it would be about 0.01 %, which is why config/checks.py stops at 3."""
  assert ORACLE_MAX_DEGREE == 3
  for n in (7, 8, 16, 64):
    _, simple = epidemic.configuration_tries(np.random.default_rng(n), n, 3, 20000)
    assert simple.mean() > 0.002, (n, simple.mean())


@pytest.mark.parametrize("overrides,message", [
    ({"outer.kind": "epidemic", "outer.rule.topology": "ring"},
     "config.outer.rule.topology='ring' is not valid: one of oracle | local."),
    ({"outer.kind": "noloco", "outer.rule.topology": "local"},
     "config.outer.rule.topology='local' is not valid: 'oracle' (the default) with outer.kind='noloco' (a topology "
     "is read by outer.kind='epidemic' alone)."),
    ({"outer.kind": "epidemic", "outer.rule.fanout": 4, "num_replicas": 16},
     "config.outer.rule.fanout=4 is not valid: one of [1, 2, 3, 12, 13, 14, 15] with outer.rule.topology='oracle' and "
     "num_replicas=16 (the exact s-regular draw needs min(s, N − 1 − s) ≤ 3), or outer.rule.topology='local'."),
])
def test_bad_topology_settings_are_one_line_naming_the_field(overrides, message):
  config = default.get_config()
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (config[section] if section else config)[field] = value
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.validate(config)
  assert str(err.value) == message


def test_local_with_a_large_fanout_is_valid():
  config = default.get_config()
  config.num_replicas = 16
  config.outer.update(kind="epidemic", rule=dict(fanout=4, topology="local"))
  config_lib.validate(config)


# ---- The round ----


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
@pytest.mark.parametrize("fanout", [1, 3])
def test_epidemic_round_matches_numpy(fanout, topology):
  theta = _theta(fanout)
  targets = epidemic.draw_targets(5, 0, N, fanout, topology)
  got = _round(_method(fanout), (epidemic.matchings(targets),), 0, theta)
  want = np_epidemic(theta, targets)
  for k in theta:
    np.testing.assert_allclose(got.params[k], want[k], atol=1e-6)
    np.testing.assert_array_equal(got.outer["slow"][k], got.params[k])


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
def test_epidemic_mesh_and_simulator_paths_agree_bitwise(topology):
  theta = _theta(3)
  schedule = epidemic.EpidemicSchedule(seed=2, num_replicas=N, fanout=2, mode="fresh", topology=topology)
  method = _method(2)
  results = {}
  for d in (N, 4, 1):
    key, route = schedule.plan(3, d)
    results[d] = _round(method, key, int(route), theta, num_devices=d)
  for d in (4, 1):
    for k in theta:
      np.testing.assert_array_equal(results[d].params[k], results[N].params[k])


def wire_bytes_per_device(hlo: str) -> tuple[np.ndarray, np.ndarray, int]:
  """(bytes each device sends, bytes each receives, number of permutes) from the compiled program: every
  collective-permute's operand bytes, once per (source, target) pair it carries."""
  sent, received = np.zeros(N, np.int64), np.zeros(N, np.int64)
  permutes = [pairs for op, pairs in hlo_lib.collective_groups(hlo) if op == "collective-permute"]
  sizes = hlo_lib.collective_ops(hlo, "collective-permute")
  assert len(permutes) == len(sizes)
  for pairs, size in zip(permutes, sizes):
    for source, target in pairs:
      assert source != target  # a replica that receives nothing copies its own model locally
      sent[source] += size
      received[target] += size
  return sent, received, len(permutes)


@pytest.mark.parametrize("topology", epidemic.TOPOLOGIES)
@pytest.mark.parametrize("fanout", [1, 3])
def test_epidemic_bytes_in_the_compiled_program(fanout, topology):
  """Each device sends s models; EL-Oracle's receive s each, EL-Local's their in-degree (read from the
  compiled permutes' operands and source-target pairs, one replica per device)."""
  theta = _theta(0)
  method = _method(fanout)
  mesh = mesh_lib.make_mesh(N, N)
  state = jax.device_put(TrainState(step=np.zeros(N, np.int32), params=theta, opt_state=(), outer={"slow": theta}),
                         mesh_lib.replica_sharding(mesh))
  targets = epidemic.draw_targets(0, 0, N, fanout, topology)
  graph = epidemic.matchings(targets)
  hlo = programs_lib.make_round_fn(method, mesh, (graph,)).lower(state, jnp.int32(0)).compile().as_text()
  model = (30 + 3) * 4
  counted = method.traffic({k: v[0] for k, v in theta.items()}, N)[0].operand
  assert counted == fanout * model
  assert hlo_lib.all_collective_bytes(hlo).keys() == {"collective-permute"}
  sent, received, _ = wire_bytes_per_device(hlo)
  np.testing.assert_array_equal(sent, np.full(N, counted))
  indegree = np.bincount(targets.ravel(), minlength=N)
  np.testing.assert_array_equal(received, indegree * model)
  if topology == "oracle":
    np.testing.assert_array_equal(received, np.full(N, counted))
  assert hlo_helpers.permute_pair_bytes(hlo) == N * counted
  # On the wire (outer/wire.py, what comm/bytes_sent_per_replica and ..._received_... add up): the mean
  # over replicas of the compiled program's, the busiest sender's, and the busiest receiver's bound
  # (exactly s models under EL-Oracle; up to N − 1 under EL-Local).
  on_wire, _ = _method(fanout, topology=topology).traffic({k: v[0] for k, v in theta.items()}, N)
  priced = hlo_lib.wire_bytes(hlo, N)["across"]
  np.testing.assert_array_equal(priced.sent, sent)
  np.testing.assert_array_equal(priced.received, received)
  assert on_wire.sent == sent.mean() == on_wire.received == received.mean() == on_wire.operand
  assert on_wire.max_sent == sent.max()
  assert received.max() <= on_wire.max_received == (model * fanout if topology == "oracle" else model * (N - 1))
  if topology == "oracle":
    assert on_wire.max_received == received.max()


def test_epidemic_training_saves_and_resumes_exactly(tmp_path, caplog, compile_cache, topology="oracle"):
  """End to end through the loop and the checkpoint (whose record holds the schedule's fan-out, topology and
  graph). The default topology only: EL-Local differs in the graphs alone, which are tested above."""
  del compile_cache  # the resumed run reuses the first one's programs (tests/conftest.py)
  import os
  import shutil

  from noloco_jax.training import loop as train

  config = default.get_config("smoke")
  config.num_steps, config.checkpoint_every = 6, 3
  config.outer.update(kind="epidemic", rule=dict(fanout=2, topology=topology))
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(config, workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
  with caplog.at_level("INFO"):
    second = train.train_and_evaluate(config, workdir)
  assert "resumed from step 3" in caplog.text
  params = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(first["state"].params))
  assert first["comm/collective_operand_bytes_per_replica"] == 2 * 2 * params * 4  # 2 rounds × fanout 2 × float32 model
  for a, b in zip(jax.tree.leaves(first["state"]), jax.tree.leaves(second["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
