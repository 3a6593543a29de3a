"""The training loop: rounds of H inner steps on every replica, then one outer step.

`train_and_evaluate(config, workdir)` is what main.py, the tests and the notebooks call. It reads top
to bottom: set-up, state built already sharded, the jitted step functions, then the loop.
"""

from __future__ import annotations

import contextlib
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

from noloco_jax.io import checkpoint as checkpoint_lib
from noloco_jax import config as config_lib
from noloco_jax.io import data as data_lib
from noloco_jax.parallel import distributed
from noloco_jax.training import inner
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.models import llama as model_lib
from noloco_jax.outer import ahead as ahead_lib
from noloco_jax.outer import methods as outer_lib
from noloco_jax.parallel import pipeline
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA
from noloco_jax.training.state import TrainState


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
  # Per-leaf NamedShardings of the state where it lives between steps (replica, fsdp; φ and δ in host
  # memory with outer.offload); None = every leaf P(REPLICA), as built by hand in tests.
  state_shardings: Any = None
  _rounds: dict = dataclasses.field(default_factory=dict)

  def outer_round(self, round_: int) -> tuple[Callable, np.ndarray]:
    """(jitted round function, route) for round `round_` (pairing.PairingSchedule.plan), compiled on first
    use. The training loop uses `round_programs` instead, which compiles each one a round ahead."""
    key, route = self._plan(round_)
    if key not in self._rounds:
      self._rounds[key] = make_round_fn(self.method, self.mesh, key, self.state_shardings)
    return self._rounds[key], route

  def _plan(self, round_: int):
    if self.schedule is None:
      return ((),), np.asarray(0, np.int32)
    return self.schedule.plan(round_, self.mesh.shape[REPLICA])

  def round_programs(self, state: TrainState) -> ahead_lib.RoundPrograms:
    """The rounds' programs, each compiled in the background while the previous round's inner steps run."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return ahead_lib.RoundPrograms(lambda key: make_round_fn(self.method, self.mesh, key, self.state_shardings),
                                   abstract, self.schedule, self.mesh.shape[REPLICA], mesh_lib.replicated(self.mesh))

  @property
  def num_replicas(self) -> int:
    return self.config.num_replicas


def make_round_fn(method: outer_lib.OuterMethod, mesh, pool, state_shardings=None) -> Callable:
  round_local = method.make_round(pool, mesh.shape[REPLICA])
  # The route (pool index or source table) is replicated (every replica runs the same branch and
  # reads the same table); states and per-replica metrics stay sharded over `replica`.
  sharded = mesh_lib.replica_map(round_local, mesh, in_specs=(P(REPLICA), P()), out_specs=(P(REPLICA), P(REPLICA)))
  if state_shardings is None:
    return jax.jit(sharded, donate_argnums=0)
  home = state_shardings.outer
  device = sharding_lib.on_device(home)

  def round_fn(state: TrainState, route):
    # φ and δ may live in host memory between rounds (outer.offload): bring them to the device for the
    # round's arithmetic and send the new ones back. Without offload both puts are no-ops.
    state = state.replace(outer=jax.device_put(state.outer, device))
    state, metrics = sharded(state, route)
    return state.replace(outer=jax.device_put(state.outer, home)), metrics

  # Explicit out_shardings: the state leaves the round laid out exactly as it came in (fsdp split
  # included), so the donated buffers are reused and the next inner step needs no reshard.
  return jax.jit(round_fn, out_shardings=(state_shardings, mesh_lib.replica_sharding(mesh)), donate_argnums=0)


def with_state_dtype(method: outer_lib.OuterMethod, dtype: str) -> outer_lib.OuterMethod:
  """The method with its outer state (φ, δ / DiLoCo's momentum) stored in `dtype` ('' = as the params).

  The rules compute in float32 and cast results back to the dtype they came in; θ ← φ would then give
  θ the outer dtype, so every leaf of the round's output is cast back to its input dtype: the state's
  dtypes never change across a round (and nothing recompiles).
  """
  if not dtype:
    return method
  dtype = model_lib.DTYPES[dtype]

  def make_round(pool, num_devices):
    round_local = method.make_round(pool, num_devices)

    def round_fn(states, route):
      new, metrics = round_local(states, route)
      return jax.tree.map(lambda x, old: x.astype(old.dtype), new, states), metrics
    return round_fn

  return dataclasses.replace(method, init=lambda params: inner.cast_floats(method.init(params), dtype),
                             make_round=make_round if method.make_round is not None else None)


def build(config: ml_collections.ConfigDict, mesh=None, vocab_size: int | None = None,
          check_data: bool = True) -> Setup:
  """Validates the config and builds the model, the mesh and the jitted, sharded step functions.

  `check_data=False` (the dry run) skips checking data paths, and opening the tokenizer when the
  vocabulary is given (`vocab_size` or config.model.vocab_size).
  """
  config_lib.validate(config)
  if vocab_size is None:
    from_config = config.model.vocab_size if not check_data else 0
    vocab_size = from_config or data_lib.make_tokenizer(config.data).vocab_size
  model_cfg = model_lib.resolve_config(config.model, vocab_size=vocab_size, seq_len=config.data.seq_len)
  if check_data:
    data_lib.validate(config.data, model_max_seq_len=model_cfg.max_seq_len, vocab_size=model_cfg.vocab_size)
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(config.num_replicas, config.num_devices, fsdp=config.fsdp,
                                                         stages=config.num_stages)
  num_replicas = config.num_replicas
  if sharding_lib.fsdp_size(mesh) > 1 and config.num_stages == 1:
    # A replica spans several devices: keep its activations split over fsdp by batch (model.constrain_batch).
    model_cfg = dataclasses.replace(model_cfg, batch_axis=mesh_lib.FSDP)
  model = model_lib.Llama(model_cfg)
  optimizer = inner.make_optimizer(config.inner, config.num_steps)
  method = with_state_dtype(outer_lib.make_method(config.outer), config.outer.state_dtype)
  schedule = outer_lib.make_schedule(config) if method.uses_pairing else None

  def init_all():
    # Every replica starts from the same weights: initialise one replica, then broadcast. Under
    # `out_shardings`, each device materialises only its own replicas; nothing is built on one device.
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), tokens)["params"]
    one = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                     outer=method.init(params))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), one)

  # Each leaf's home: replica axis over `replica`, one dimension over `fsdp` (sharding.py), and with
  # outer.offload φ and δ in pinned host memory. Computed from shapes only: nothing is allocated.
  # With pipeline stages, the layer axis and the ends are also split over `stage` (pipeline.py).
  layout = pipeline.state_shardings if config.num_stages > 1 else sharding_lib.state_shardings
  state_sh = sharding_lib.offload(layout(jax.eval_shape(init_all), mesh), config.outer.offload)
  per_replica = mesh_lib.replica_sharding(mesh)
  init_state = jax.jit(init_all, out_shardings=state_sh)

  step_local = mesh_lib.replica_map(inner.make_inner_step(model.apply, optimizer, method.reduce_grads,
                                                           config.inner.microbatches), mesh,
                                    in_specs=(P(REPLICA), P(REPLICA)), out_specs=(P(REPLICA), P(REPLICA)))
  if config.num_stages > 1:  # the micro-batched GPipe schedule, manual over `replica` and `stage`
    step_local = pipeline.make_inner_step(config, model_cfg, mesh, method.reduce_grads)

  def step(state: TrainState, batch):
    # The inner step never reads φ or δ: they go around the shard_map untouched (and, donated, are
    # aliased in place), so that with outer.offload they stay in host memory during the inner steps.
    new, metrics = step_local(state.replace(outer=()), batch)
    return new.replace(outer=state.outer), metrics

  # `fsdp` is automatic inside the shard_map: the batch arrives split over fsdp on its sequence axis
  # (mesh.global_array), the weights split per leaf (activations pinned to the batch split,
  # model.constrain_batch), and XLA all-gathers each weight where it is used and reduces its gradient
  # over fsdp. out_shardings pins the new state to the same layout.
  inner_step = jax.jit(step, out_shardings=(state_sh, per_replica), donate_argnums=0)

  def eval_local(params, batch_BxL1):
    # Every replica scores the same validation batch; inside a replica group its sequences are split
    # over fsdp like a training batch (a local slice of the replicated batch, no communication).
    batch_BxL1 = jax.lax.with_sharding_constraint(batch_BxL1, sharding_lib.eval_batch_sharding(mesh, batch_BxL1.shape))
    evaluate_local = inner.make_eval_step(model.apply, config.inner.microbatches)
    return mesh_lib.replica_map(evaluate_local, mesh, in_specs=(P(REPLICA), P()), out_specs=P(REPLICA))(
        params, batch_BxL1)

  # With stages: the pipeline with fixed routing (each replica's own stages in order).
  eval_step = jax.jit(pipeline.make_eval_step(config, model_cfg, mesh) if config.num_stages > 1 else eval_local)
  weight_std = jax.jit(metrics_lib.weight_std)
  return Setup(config=config, mesh=mesh, model_config=model_cfg, model=model, method=method,
               schedule=schedule, init_state=init_state, inner_step=inner_step, eval_step=eval_step,
               weight_std=weight_std, state_shardings=state_sh)


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
  # Then the latest checkpoint of this workdir, else the warm start, else this fresh state (checkpoint.py).
  checkpointer = checkpoint_lib.Checkpointer(setup, workdir)
  state, resume = checkpointer.restore(state, train_iter)
  one_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
  num_params = model_lib.num_params(setup.model_config)
  bytes_per_round = setup.method.bytes_per_round(one_replica)
  bytes_per_step = setup.method.bytes_per_step(one_replica)
  H = config.outer.inner_steps

  writer = metrics_lib.make_writer(workdir)
  if resume is None:
    writer.write_scalars(0, {"model/num_params": num_params})
  pairing_log = open(os.path.join(workdir, "pairings.jsonl"), "a") if is_main and setup.schedule else None
  report = periodic_actions.ReportProgress(num_train_steps=config.num_steps, every_secs=30)
  tokens_per_step = n * config.data.batch_size * config.data.seq_len

  history: dict[str, Any] = {"eval": []}
  pending_steps, pending_metrics, pending_round = [], [], []
  comm_bytes, round_, first_step, preempted = 0, 0, 1, False
  if resume is not None:  # the interrupted run's counters, history and fetched-but-unlogged metrics
    history, comm_bytes, round_, first_step = resume.history, resume.comm_bytes, resume.round, resume.step + 1
    pending_steps, pending_metrics, pending_round = resume.pending
  last_log_time, last_log_step = time.time(), first_step - 1
  guard = checkpoint_lib.RoundGuard(config, mesh)  # active only with nan_policy="skip_round"
  # Round t's program compiles in the background during round t's inner steps (outer/ahead.py).
  round_programs = setup.round_programs(state) if setup.method.has_rounds else None
  if round_programs is not None:
    round_programs.prefetch(round_)

  if resume is None:
    scalars = evaluate(setup, state, eval_batches)  # step 0: the untrained baseline
    writer.write_scalars(0, scalars)
    history["eval"].append({"step": 0, **scalars})

  try:
    for step in range(first_step, config.num_steps + 1):
      guard.begin(step, state)
      batch = mesh_lib.global_array(mesh, next(train_iter), n)
      state, step_metrics = setup.inner_step(state, batch)
      guard.observe(step_metrics["loss"])
      comm_bytes += bytes_per_step
      pending_steps.append(step)
      pending_metrics.append(step_metrics)  # device arrays: fetched only when logging

      if setup.method.has_rounds and step % H == 0:
        round_fn, route = round_programs.program(round_)  # also starts compiling round_ + 1's
        state, round_metrics = round_fn(state, route)
        comm_bytes += bytes_per_round
        pending_round.append((round_metrics, setup.weight_std(state.params)))
        if pairing_log is not None:
          row = {"round": round_, "step": step, "groups": [list(g) for g in setup.schedule.groups(round_)]}
          if setup.schedule.mode == "round_robin":
            row["matching"] = setup.schedule.index(round_)
          pairing_log.write(json.dumps(row) + "\n")
        round_ += 1
      state = guard.end(step, state, history)
      report(step)

      if step % max(config.log_every, 1) == 0 or step == config.num_steps:
        # One gather per log interval (a collective over all processes in a multi-process job), never per step.
        pending_metrics, pending_round = mesh_lib.fetch((pending_metrics, pending_round))
        losses = np.stack([np.asarray(m["loss"]) for m in pending_metrics])
        if config.nan_policy == "error":
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

      preempted = checkpoint_lib.stop_requested(step, config.log_every)  # SIGTERM; agreed by all processes
      if checkpointer.due(step) or preempted:
        pending = checkpoint_lib.pending_to_host(pending_steps, pending_metrics, pending_round)
        if config.nan_policy == "error":  # never save a state whose losses were not checked
          check_finite(checkpoint_lib.pending_losses(pending), pending_steps)
        checkpointer.save(step, state, train_iter, round_=round_, comm_bytes=comm_bytes, history=history,
                          pending=pending)
      if preempted:
        logging.warning("Stop requested: saved a checkpoint at step %d; run the same command to resume.", step)
        break
  except BaseException:
    if round_programs is not None:
      round_programs.close()
    # Leave no prefetch thread or open writer behind an error (e.g. a NaN stop in a notebook), and
    # flush the metrics written so far. The checkpointer is not closed here: in a multi-process job
    # its close waits for the other processes, which may be the ones that failed.
    with contextlib.suppress(Exception):
      train_iter.close()
      writer.close()
    raise

  if round_programs is not None:
    round_programs.close()
  checkpointer.close()  # the last (asynchronous) save is complete before the run reports
  writer.flush()
  train_iter.close()
  if pairing_log is not None:
    pairing_log.close()
  if preempted:
    writer.close()
    return {"preempted": True, "step": step, "state": state, "history": history}
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
