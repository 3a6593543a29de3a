"""The training loop: rounds of H inner steps on every replica, then one outer step.

`train_and_evaluate(config, workdir)` is what main.py, the tests and the notebooks call. It reads top
to bottom: set-up, state built already sharded, the jitted step functions, then the loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from clu import periodic_actions
from jax.sharding import PartitionSpec as P

from noloco_jax import config as config_lib
from noloco_jax import data as data_lib
from noloco_jax import distributed
from noloco_jax import inner
from noloco_jax import mesh as mesh_lib
from noloco_jax import metrics as metrics_lib
from noloco_jax import model as model_lib
from noloco_jax import outer as outer_lib
from noloco_jax.mesh import REPLICA
from noloco_jax.state import TrainState


class NonFiniteLossError(FloatingPointError):
  pass


@dataclasses.dataclass
class Setup:
  """Everything a run needs besides its state; tests, benchmarks and notebooks build one directly."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model_config: model_lib.LlamaConfig
  model: model_lib.Llama
  method: outer_lib.OuterMethod
  schedule: outer_lib.PairingSchedule | None
  init_state: Callable[[], TrainState]  # jitted, returns the [N, ...] replica-sharded state
  inner_step: Callable  # jitted: (state, batch [N, B, L+1]) -> (state, {"loss": [N], "grad_norm": [N]})
  eval_step: Callable  # jitted: (params, batch [B, L+1]) -> loss [N]
  weight_std: Callable  # jitted: params -> scalar
  _rounds: dict = dataclasses.field(default_factory=dict)

  def outer_round(self, round_: int) -> tuple[Callable, int]:
    """(jitted round function, pool index) for round `round_`. `fresh` pairings compile once each."""
    if self.schedule is None:
      pool, index = ((),), 0
    elif self.schedule.mode == "fresh":
      pool, index = (self.schedule.groups(round_),), 0
    else:
      pool, index = self.schedule.pool, self.schedule.index(round_)
    if pool not in self._rounds:
      self._rounds[pool] = make_round_fn(self.method, self.mesh, pool)
    return self._rounds[pool], index

  @property
  def num_replicas(self) -> int:
    return self.config.num_replicas


def make_round_fn(method: outer_lib.OuterMethod, mesh, pool) -> Callable:
  round_local = method.make_round(pool, mesh.shape[REPLICA])
  # The pool index is replicated (every replica runs the same branch); states and per-replica
  # metrics stay sharded over `replica`.
  sharded = mesh_lib.replica_map(round_local, mesh, in_specs=(P(REPLICA), P()), out_specs=(P(REPLICA), P(REPLICA)))
  return jax.jit(sharded, donate_argnums=0)


def build(config: ml_collections.ConfigDict, mesh=None, vocab_size: int | None = None) -> Setup:
  """Validates the config and builds the model, the mesh and the jitted, sharded step functions."""
  config_lib.validate(config)
  if vocab_size is None:
    vocab_size = data_lib.make_tokenizer(config.data).vocab_size
  model_cfg = model_lib.resolve_config(config.model, vocab_size=vocab_size, seq_len=config.data.seq_len)
  data_lib.validate(config.data, model_max_seq_len=model_cfg.max_seq_len, vocab_size=model_cfg.vocab_size)
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(config.num_replicas, config.num_devices)
  num_replicas = config.num_replicas
  model = model_lib.Llama(model_cfg)
  optimizer = inner.make_optimizer(config.inner, config.num_steps)
  method = outer_lib.make_method(config.outer)
  schedule = outer_lib.make_schedule(config) if method.uses_pairing else None

  def init_all():
    # Every replica starts from the same weights: initialise one replica, then broadcast. Under
    # `out_shardings`, each device materialises only its own replicas; nothing is built on one device.
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), tokens)["params"]
    one = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                     outer=method.init(params))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), one)

  replica_sharded = mesh_lib.replica_sharding(mesh)
  init_state = jax.jit(init_all, out_shardings=replica_sharded)

  step_local = inner.make_inner_step(model.apply, optimizer, method.reduce_grads)
  inner_step = jax.jit(
      mesh_lib.replica_map(step_local, mesh, in_specs=(P(REPLICA), P(REPLICA)), out_specs=(P(REPLICA), P(REPLICA))),
      donate_argnums=0)
  # Evaluation: the validation batch is replicated, each replica scores it with its own weights.
  eval_step = jax.jit(mesh_lib.replica_map(inner.make_eval_step(model.apply), mesh,
                                           in_specs=(P(REPLICA), P()), out_specs=P(REPLICA)))
  weight_std = jax.jit(metrics_lib.weight_std)
  return Setup(config=config, mesh=mesh, model_config=model_cfg, model=model, method=method,
               schedule=schedule, init_state=init_state, inner_step=inner_step, eval_step=eval_step,
               weight_std=weight_std)


def evaluate(setup: Setup, state: TrainState, eval_batches: jax.Array) -> dict[str, float]:
  """eval/loss = mean over replicas of each replica's mean validation loss; eval/ppl = exp of it."""
  losses = [setup.eval_step(state.params, eval_batches[i]) for i in range(eval_batches.shape[0])]
  losses = mesh_lib.fetch(losses)  # per-replica losses live on every process: one all-gather
  per_replica = np.mean(np.stack([np.asarray(x) for x in losses]), axis=0)
  loss = float(np.mean(per_replica))
  return {"eval/loss": loss, "eval/ppl": float(np.exp(loss)),
          "replicas/weight_std": float(setup.weight_std(state.params))}


def check_finite(losses_SxN: np.ndarray, steps: list[int]) -> None:
  """Raises NonFiniteLossError naming the first step and replica whose loss is NaN or Inf."""
  bad = ~np.isfinite(losses_SxN)
  if bad.any():
    s, r = np.argwhere(bad)[0]
    raise NonFiniteLossError(f"non-finite training loss {losses_SxN[s, r]} at step {steps[s]} on replica {r}.")


# ---------------------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config.num_replicas` replicas for `config.num_steps` steps; returns the final metrics."""
  start_time = time.time()
  os.makedirs(workdir, exist_ok=True)
  setup = build(config)
  mesh, n = setup.mesh, config.num_replicas
  is_main = jax.process_index() == 0
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))

  # ---- Data: each process reads only the replicas its devices hold. ----
  local_ids = mesh_lib.local_replica_ids(mesh, n)
  train_iter = data_lib.make_train_iterator(config.data, seed=config.seed, replica_ids=local_ids, num_replicas=n,
                                            vocab_size=setup.model_config.vocab_size)
  # The validation sample is drawn with a fixed seed, not config.seed, so that runs with different
  # seeds (e.g. compare_methods.py) are scored on the same sequences.
  eval_batches = jax.device_put(
      data_lib.make_eval_batches(config.data, seed=0, vocab_size=setup.model_config.vocab_size),
      mesh_lib.replicated(mesh))
  logging.info("Global batch: %d replicas × %d sequences × %d tokens; %d devices (%d replicas each); "
               "process %d of %d holds replicas %s.", n, config.data.batch_size, config.data.seq_len,
               mesh.devices.size, mesh_lib.replicas_per_device(mesh, n), jax.process_index(),
               jax.process_count(), local_ids)

  # ---- State, built sharded. ----
  state = setup.init_state()
  # All processes agree on config/seed/layout and every replica starts bit-identical (before any restore).
  distributed.check_consistency(config, mesh, state)
  one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  num_params = model_lib.num_params(setup.model_config)
  bytes_per_round = setup.method.bytes_per_round(one_replica)
  bytes_per_step = setup.method.bytes_per_step(one_replica)
  H = config.outer.inner_steps

  writer = metrics_lib.make_writer(workdir)
  writer.write_scalars(0, {"model/num_params": num_params})
  pairing_log = open(os.path.join(workdir, "pairings.jsonl"), "a") if is_main and setup.schedule else None
  report = periodic_actions.ReportProgress(num_train_steps=config.num_steps, every_secs=30)
  tokens_per_step = n * config.data.batch_size * config.data.seq_len

  history: dict[str, Any] = {"eval": []}
  pending_steps, pending_metrics, pending_round = [], [], []
  comm_bytes, round_ = 0, 0
  last_log_time, last_log_step = time.time(), 0

  scalars = evaluate(setup, state, eval_batches)  # step 0: the untrained baseline
  writer.write_scalars(0, scalars)
  history["eval"].append({"step": 0, **scalars})

  for step in range(1, config.num_steps + 1):
    batch = mesh_lib.global_array(mesh, next(train_iter), n)
    state, step_metrics = setup.inner_step(state, batch)
    comm_bytes += bytes_per_step
    pending_steps.append(step)
    pending_metrics.append(step_metrics)  # device arrays: fetched only when logging

    if setup.method.has_rounds and step % H == 0:
      round_fn, pool_index = setup.outer_round(round_)
      state, round_metrics = round_fn(state, jnp.int32(pool_index))
      comm_bytes += bytes_per_round
      pending_round.append((round_metrics, setup.weight_std(state.params)))
      if pairing_log is not None:
        pairing_log.write(json.dumps({"round": round_, "step": step, "pool_index": pool_index,
                                      "groups": [list(g) for g in setup.schedule.groups(round_)]}) + "\n")
      round_ += 1
    report(step)

    if step % max(config.log_every, 1) == 0 or step == config.num_steps:
      # One gather per log interval (a collective over all processes in a multi-process job), never per step.
      pending_metrics, pending_round = mesh_lib.fetch((pending_metrics, pending_round))
      losses = np.stack([np.asarray(m["loss"]) for m in pending_metrics])
      check_finite(losses, pending_steps)
      now = time.time()
      steps_per_s = (step - last_log_step) / max(now - last_log_time, 1e-9)
      scalars = {
          "train/loss": float(losses.mean()),
          "train/grad_norm": float(np.mean([np.asarray(m["grad_norm"]) for m in pending_metrics])),
          "comm/bytes_per_replica": comm_bytes,
          "outer/round": round_,
          "perf/steps_per_s": steps_per_s,
          "perf/tokens_per_s": steps_per_s * tokens_per_step,
      }
      if pending_round:
        scalars["outer/pseudo_grad_norm"] = float(np.mean([np.asarray(m["pseudo_grad_norm"]) for m, _ in pending_round]))
        scalars["replicas/weight_std"] = float(pending_round[-1][1])
      writer.write_scalars(step, scalars)
      history["train"] = scalars
      pending_steps, pending_metrics, pending_round = [], [], []
      last_log_time, last_log_step = time.time(), step

    if (config.eval_every and step % config.eval_every == 0) or step == config.num_steps:
      with report.timed("eval"):
        scalars = evaluate(setup, state, eval_batches)
      writer.write_scalars(step, scalars)
      history["eval"].append({"step": step, **scalars})
      last_log_time = time.time()  # keep evaluation out of the steps/s figure

  writer.flush()
  train_iter.close()
  if pairing_log is not None:
    pairing_log.close()
  summary = _summary(config, history, num_params, comm_bytes, time.time() - start_time)
  if is_main:
    print(summary["text"], flush=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "text"}, f, indent=2)
  writer.close()
  return {**summary, "state": state, "history": history}


def _summary(config, history, num_params, comm_bytes, seconds) -> dict[str, Any]:
  evals = history["eval"]
  first, last = evals[0], evals[-1]
  train = history.get("train", {})
  lines = [
      "=" * 72,
      f"noloco_jax: {config.outer.kind} | {config.num_replicas} replicas | {config.num_steps} steps "
      f"| H={config.outer.inner_steps} | model {config.model.preset} ({num_params:,} params per replica)",
      f"eval/loss   {first['eval/loss']:.4f} (step {first['step']}) -> {last['eval/loss']:.4f} (step {last['step']})",
      f"eval/ppl    {last['eval/ppl']:.3f}",
      f"train/loss  {train.get('train/loss', float('nan')):.4f}",
      f"replicas/weight_std  {last['replicas/weight_std']:.3e}",
      f"comm/bytes_per_replica  {comm_bytes:,} ({comm_bytes / 2**20:.1f} MiB)",
      f"wall time   {seconds:.1f} s  ({train.get('perf/steps_per_s', float('nan')):.2f} steps/s at the last log)",
      "=" * 72,
  ]
  return {"text": "\n".join(lines), "eval/loss": last["eval/loss"], "eval/ppl": last["eval/ppl"],
          "eval/loss_first": first["eval/loss"], "replicas/weight_std": last["replicas/weight_std"],
          "comm/bytes_per_replica": comm_bytes, "wall_time_s": seconds, "model/num_params": num_params}
