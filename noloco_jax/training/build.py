"""Everything a run needs besides its state: the model, the mesh, the jitted and sharded step functions.

`build(config)` returns a `Setup` (a ConfigDict is parsed and checked first, by `config.load`); `train_and_evaluate` (loop.py), the
tests, the benchmarks, the dry run and the notebooks all start from one. The inner step is chosen
once: the plain step (inner/step.py mapped over `replica`), or with `num_stages` > 1 the pipelined
one (parallel/pipeline.py), each with its own state layout and evaluation step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from noloco_jax import config as config_lib
from noloco_jax import models
from noloco_jax.inner import replicas as replicas_lib
from noloco_jax.inner import step as inner
from noloco_jax.inner.state import TrainState
from noloco_jax.io import data as data_lib
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.outer import base as outer_base
from noloco_jax.outer import methods
from noloco_jax.outer import programs as programs_lib
from noloco_jax.outer import streaming
from noloco_jax.outer.pairing import PairingSchedule
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import pipeline
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA


@dataclasses.dataclass
class Setup:
  """Everything a run needs besides its state; tests, benchmarks and notebooks build one with `build`."""
  config: config_lib.Config
  mesh: jax.sharding.Mesh
  model: models.base.Model
  method: outer_base.OuterMethod
  schedule: PairingSchedule | None
  init_state: Callable[[], TrainState]  # jitted, returns the [N, ...] replica-sharded state
  inner_step: Callable  # jitted: (state, batch [N, B, L+1]) -> (state, {"loss": [N], "grad_norm": [N]})
  eval_step: Callable  # jitted: (params, batch [B, L+1]) -> loss [N]
  weight_std: Callable  # jitted: params -> scalar
  rounds: programs_lib.RoundPrograms  # round r -> (jitted round function, route); .start(state) for the loop
  # Per-leaf NamedShardings of the state where it lives between steps (replica, fsdp; φ and δ in host
  # memory with outer.offload).
  state_shardings: Any = None
  replica_map: str = "vmap"  # how each device runs its replicas: vmap or sequential (inner/replicas.py)
  # Fragment streaming (outer.streaming.fragments > 1): the fragments of the message (outer/streaming.cut),
  # each with its round every H steps at its own offset; `schedule` is then the streamed pairing
  # (outer/streaming.Pairing, by fragment round). None: the whole message every H steps.
  fragments: tuple | None = None
  # A process of an asynchronous job (asynchronous/job.Process: its slot, the job's replica it holds, its
  # control plane), set by train_and_evaluate; None: this run is the whole job.
  process: Any = None

  @property
  def num_replicas(self) -> int:
    return self.config.num_replicas


def build(config, mesh=None, vocab_size: int | None = None,
          check_data: bool = True, platform: str | None = None) -> Setup:
  """Validates the config and builds the model, the mesh and the jitted, sharded step functions.

  `check_data=False` (the dry run) skips checking data paths, and opening the tokenizer when the
  vocabulary is given (`vocab_size` or config.model.vocab_size). `platform`: the backend the run is
  for, which decides what inner.replica_map=auto builds (default: the mesh's devices'; the dry run
  compiles on fake CPU devices for accelerators).
  """
  config = config_lib.load(config)  # a typed config is taken as it is
  spec = tokenizer = None
  if check_data:  # the data's paths and the tokenizer's file first: a missing one is a ConfigError naming its field
    spec, tokenizer = data_lib.validate_with_tokenizer(config.data)
  if vocab_size is None:
    from_config = config.model.vocab_size if not check_data else 0
    vocab_size = from_config or (tokenizer or data_lib.make_tokenizer(config.data)).vocab_size
  model = models.get(config.model.arch).resolve(config.model, vocab_size=vocab_size, seq_len=config.data.seq_len)
  if check_data:
    data_lib.check_against_model(spec, tokenizer, model_max_seq_len=model.max_seq_len, vocab_size=model.vocab_size)
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(config.num_replicas, config.num_devices, fsdp=config.fsdp,
                                                         stages=config.num_stages)
  if sharding_lib.fsdp_size(mesh) > 1 and config.num_stages == 1:
    # A replica spans several devices: keep its activations split over fsdp by batch (llama.constrain_batch).
    model = model.with_batch_axis(mesh_lib.FSDP)
  pipelined = config.num_stages > 1
  # With stages, the pipeline clips across stages itself (config.pipeline.clip): the optimizer's
  # clipping slot is then an identity, and the optimizer state keeps the same tree.
  optimizer = inner.make_optimizer(config.inner, config.num_steps, clip=not pipelined)
  # epidemic_adam's round takes one more step of this optimizer, unclipped (outer/methods/epidemic_adam.py).
  method = methods.make(config.outer, inner.make_optimizer(config.inner, config.num_steps, clip=False))
  # The asynchronous schedule pairs processes at run time (asynchronous/): no schedule of groupings.
  schedule = (methods.schedule(config.outer, seed=config.seed, num_replicas=config.num_replicas)
              if config.outer.schedule == "lockstep" else None)
  num_replicas = config.num_replicas
  fragments = None
  if config.outer.streaming.fragments > 1:  # refused in one line here when the model has too few slices
    one = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, config.data.seq_len), jnp.int32))
    roles = [model.stage_role(path) for path, _ in jax.tree_util.tree_flatten_with_path(one)[0]]
    s = config.outer.streaming
    fragments = streaming.cut(one, roles, fragments=s.fragments, split=s.split)
    if schedule is not None:  # the asynchronous schedule's partners are found at run time, per fragment round
      schedule = streaming.Pairing(schedule, fragments=s.fragments, partners=s.partners)

  def init_all():
    # Every replica starts from the same weights: initialise one replica, then broadcast. Under
    # `out_shardings`, each device materialises only its own replicas; nothing is built on one device.
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), tokens)
    one = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                     outer=method.init(params))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), one)

  how = "vmap"
  if pipelined:  # the micro-batched GPipe schedule, manual over `replica` and `stage`
    layout = lambda abstract, mesh_: pipeline.state_shardings(abstract, mesh_, model)
    routes = lambda mode=None: pipeline.route_schedule(config.pipeline, seed=config.seed, num_replicas=num_replicas,
                                                       num_stages=config.num_stages, batch_size=config.data.batch_size,
                                                       mode=mode)
    step_local = pipeline.make_inner_step(config.pipeline, model, mesh, optimizer, routes(),
                                          grad_clip=config.inner.grad_clip, reduce_grads=method.reduce_grads)
    # Evaluation runs the pipeline with fixed routing (each replica's own stages in order).
    eval_fn = pipeline.make_eval_step(model, mesh, routes("fixed"), config.data.batch_size)
  else:
    layout = sharding_lib.state_shardings
    # A device's k replicas: batched or one after another (inner/replicas.py: `auto` loops on CPU).
    how = replicas_lib.resolve(config.inner.replica_map, mesh_lib.replicas_per_device(mesh, num_replicas),
                               platform or mesh.devices.flat[0].platform)
    step_local = mesh_lib.replica_map(
        inner.make_inner_step(model.loss, optimizer, method.reduce_grads, config.inner.microbatches, how), mesh,
        in_specs=(P(REPLICA), P(REPLICA)), out_specs=(P(REPLICA), P(REPLICA)))
    eval_fn = _replica_eval(model, mesh, config.inner.microbatches, how)

  # Each leaf's home: replica axis over `replica`, one dimension over `fsdp` (sharding.py), and with
  # outer.offload φ and δ in pinned host memory. Computed from shapes only: nothing is allocated.
  # With pipeline stages, the layer axis and the ends are also split over `stage` (pipeline.py).
  state_sh = sharding_lib.offload(layout(jax.eval_shape(init_all), mesh), config.outer.offload)

  def step(state: TrainState, batch):
    # The inner step never reads φ or δ: they go around the shard_map untouched (and, donated, are
    # aliased in place), so that with outer.offload they stay in host memory during the inner steps.
    new, metrics = step_local(state.replace(outer=()), batch)
    return new.replace(outer=state.outer), metrics

  # `fsdp` is automatic inside the shard_map: the batch arrives split over fsdp on its sequence axis
  # (sharding.global_array), the weights split per leaf (activations pinned to the batch split,
  # llama.constrain_batch), and XLA all-gathers each weight where it is used and reduces its gradient
  # over fsdp. out_shardings pins the new state to the same layout.
  inner_step = jax.jit(step, out_shardings=(state_sh, mesh_lib.replica_sharding(mesh)), donate_argnums=0)
  return Setup(config=config, mesh=mesh, model=model, method=method, schedule=schedule,
               init_state=jax.jit(init_all, out_shardings=state_sh), inner_step=inner_step,
               eval_step=jax.jit(eval_fn), weight_std=jax.jit(metrics_lib.weight_std),
               rounds=programs_lib.RoundPrograms(method, mesh, getattr(schedule, "base", schedule), state_sh), state_shardings=state_sh,
               replica_map=how, fragments=fragments)


def _replica_eval(model: models.base.Model, mesh, microbatches: int, replica_map: str) -> Callable:
  """eval(params [N, ...], batch [B, L+1]) -> loss [N] without pipeline stages."""
  evaluate_local = inner.make_eval_step(model.loss, microbatches, replica_map)

  def eval_fn(params, batch_BxL1):
    # Every replica scores the same validation batch; inside a replica group its sequences are split
    # over fsdp like a training batch (a local slice of the replicated batch, no communication).
    batch_BxL1 = jax.lax.with_sharding_constraint(batch_BxL1, sharding_lib.eval_batch_sharding(mesh, batch_BxL1.shape))
    return mesh_lib.replica_map(evaluate_local, mesh, in_specs=(P(REPLICA), P()), out_specs=P(REPLICA))(
        params, batch_BxL1)

  return eval_fn
