"""A Llama decoder in Flax: RMSNorm, rotary embeddings, SwiGLU MLP, causal multi-head attention, untied
embeddings. Sizes come from presets (docs/method.md §10) and can be overridden field by field.
`LlamaModel` (at the end) is its implementation of the model interface (models/base.py).

The layers are stacked with `nn.scan`, so every layer parameter carries a leading `num_layers` axis:
compile time does not grow with depth, and a pipeline stage is a contiguous slice of that axis.

Shape suffixes: B batch, L sequence, D model width, H heads, K head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from noloco_jax.config.model import PRESETS  # hidden / layers / heads / MLP per preset
from noloco_jax.models import base
from noloco_jax.models.base import DTYPES
from noloco_jax.models import attention as attention_lib
from noloco_jax.models import losses

# What a rematerialised layer keeps for its backward pass (model.remat_policy; only with model.remat):
# "nothing" = its input only (all else recomputed); "dots" = also the results of its matmuls with
# no batch dimension (the projections and the MLP; not attention's scores), recomputing only the cheap
# elementwise work in between.
REMAT_POLICIES = {"nothing": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  dtype: Any = jnp.float32  # compute dtype
  param_dtype: Any = jnp.float32
  remat: bool = False  # recompute each layer's activations in the backward pass
  remat_policy: str = "nothing"  # a key of REMAT_POLICIES
  attention: str = "auto"  # one of attention.IMPLEMENTATIONS ("auto" picks by backend and dtype when traced)
  loss_chunk: int = 0  # sequence positions per chunk of the loss (losses.py); 0 = plain loss
  # Mesh axis the batch dimension of activations is split over (e.g. "fsdp"), or None. Set by
  # training.build when a replica spans several devices; see `constrain_batch`.
  batch_axis: str | None = None

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def resolve_config(model_cfg: ml_collections.ConfigDict, *, vocab_size: int, seq_len: int) -> LlamaConfig:
  """Turns `config.model` (preset + overrides, 0 = from preset) into a LlamaConfig."""
  sizes = dict(PRESETS[model_cfg.preset])
  for name in sizes:
    if model_cfg[name]:
      sizes[name] = int(model_cfg[name])
  return LlamaConfig(
      vocab_size=int(model_cfg.vocab_size or vocab_size),
      max_seq_len=int(model_cfg.max_seq_len or seq_len),
      rope_theta=float(model_cfg.rope_theta),
      norm_eps=float(model_cfg.norm_eps),
      dtype=DTYPES[model_cfg.dtype],
      param_dtype=DTYPES[model_cfg.param_dtype],
      remat=bool(model_cfg.remat),
      remat_policy=str(model_cfg.remat_policy),
      attention=str(model_cfg.attention),
      loss_chunk=int(model_cfg.loss_chunk),
      **sizes,
  )


def num_params(cfg: LlamaConfig) -> int:
  """Analytic parameter count (embeddings and head untied, no biases)."""
  D, F, V = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
  per_layer = 4 * D * D + 3 * D * F + 2 * D  # q,k,v,o; gate,up,down; two RMSNorm scales
  return 2 * V * D + cfg.num_layers * per_layer + D  # embed, head, layers, final norm


_init = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x_BxLxD):
    scale_D = self.param("scale", nn.initializers.ones, (x_BxLxD.shape[-1],), self.param_dtype)
    # Normalise in float32: a bf16 mean of squares loses too much precision.
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D.astype(jnp.float32)).astype(self.dtype)


def rope(x_BxLxHxK, positions_L, theta: float):
  """Rotary position embedding, rotating pairs (i, i + K/2) of each head's features."""
  half = x_BxLxHxK.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles_LxK2 = positions_L[:, None].astype(jnp.float32) * freqs[None, :]
  sin, cos = jnp.sin(angles_LxK2)[None, :, None, :], jnp.cos(angles_LxK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    cfg = self.cfg
    H, K = cfg.num_heads, cfg.head_dim
    dense = lambda name: nn.DenseGeneral((H, K), use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                         kernel_init=_init, name=name)
    positions_L = jnp.arange(x_BxLxD.shape[1])
    q_BxLxHxK = rope(dense("q")(x_BxLxD), positions_L, cfg.rope_theta)
    k_BxLxHxK = rope(dense("k")(x_BxLxD), positions_L, cfg.rope_theta)
    v_BxLxHxK = dense("v")(x_BxLxD)
    kernel = attention_lib.resolve(cfg.attention, cfg.dtype, K)
    out_BxLxHxK = attention_lib.causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, kernel)
    return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, kernel_init=_init, name="o")(out_BxLxHxK)


class SwiGLU(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    cfg = self.cfg
    dense = lambda features, name: nn.Dense(features, use_bias=False, dtype=cfg.dtype,
                                            param_dtype=cfg.param_dtype, kernel_init=_init, name=name)
    h_BxLxF = nn.silu(dense(cfg.mlp_dim, "gate")(x_BxLxD)) * dense(cfg.mlp_dim, "up")(x_BxLxD)
    return dense(cfg.d_model, "down")(h_BxLxF)


def constrain_batch(x, axis: str | None):
  """Pins an activation's batch dimension (its first) to mesh axis `axis`; a no-op for None.

  Why: inside a replica the weights are stored split over `fsdp` along whichever dimension divides
  (noloco_jax/parallel/sharding.py), and left alone XLA's propagation may follow a weight's split into the
  activations (e.g. logits split over the vocabulary, then all-to-all'd back), moving activation-sized
  tensors. Pinning the activations to the batch split at every layer boundary leaves one cheap choice:
  all-gather each weight where it is used (FSDP), reduce-scatter its gradient.
  """
  # Only where a mesh with that axis is in context (the step functions' shard_map); initialisation
  # and single-device uses of the model have none and need no constraint.
  if axis is None or axis not in jax.sharding.get_abstract_mesh().axis_names:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axis))


class Block(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BxLxD, _):
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name=name)
    x_BxLxD = x_BxLxD + Attention(cfg, name="attn")(norm("attn_norm")(x_BxLxD))
    x_BxLxD = x_BxLxD + SwiGLU(cfg, name="mlp")(norm("mlp_norm")(x_BxLxD))
    return constrain_batch(x_BxLxD, cfg.batch_axis), None


class Layers(nn.Module):
  """`num_layers` Blocks as one scanned module: parameters stacked on a leading layer axis."""
  cfg: LlamaConfig
  num_layers: int

  @nn.compact
  def __call__(self, x_BxLxD):
    block = (nn.remat(Block, prevent_cse=False, policy=REMAT_POLICIES[self.cfg.remat_policy])
             if self.cfg.remat else Block)
    scanned = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.num_layers)
    x_BxLxD, _ = scanned(self.cfg, name="blocks")(x_BxLxD, None)
    return x_BxLxD


class Llama(nn.Module):
  cfg: LlamaConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=cfg.dtype,
                          param_dtype=cfg.param_dtype)
    self.layers = Layers(cfg, cfg.num_layers)
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype)
    self.head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         kernel_init=_init)

  def __call__(self, tokens_BxL):
    """Returns float32 logits [B, L, V] for next-token prediction."""
    return self.logits(self.layers(self.embed_tokens(tokens_BxL)))

  # The two ends as methods of their own, so that a pipeline stage can run just its part
  # (`apply(..., method=Llama.embed_tokens)` needs only params["embed"]; see pipeline.py).
  def embed_tokens(self, tokens_BxL):
    return constrain_batch(self.embed(tokens_BxL), self.cfg.batch_axis)

  def logits(self, x_BxLxD):
    return constrain_batch(self.head(self.final_norm(x_BxLxD)).astype(jnp.float32), self.cfg.batch_axis)

  def next_token_loss(self, tokens_BxL, targets_BxL):
    """Mean next-token cross-entropy of the whole model."""
    return self.head_loss(self.layers(self.embed_tokens(tokens_BxL)), targets_BxL)

  def head_loss(self, x_BxLxD, targets_BxL):
    """The last layer's output to the mean loss; with cfg.loss_chunk never holding [B, L, V] logits
    (losses.py). Needs params["final_norm"] and params["head"] only (a pipeline's last stage)."""
    if not self.cfg.loss_chunk:
      return losses.cross_entropy(self.logits(x_BxLxD), targets_BxL)
    x_BxLxD = constrain_batch(self.final_norm(x_BxLxD), self.cfg.batch_axis)
    return losses.chunked_cross_entropy(x_BxLxD, self.variables["params"]["head"]["kernel"], targets_BxL,
                                        self.cfg.loss_chunk)

class LlamaModel(base.Model):
  """Llama behind the model interface: embedding first, the scanned layers, final norm and head last."""

  arch = "llama"
  stage_roles = {"embed": "first", "layers": "layers", "final_norm": "last", "head": "last"}

  def __init__(self, config: LlamaConfig):
    self.config = config
    self.module = Llama(config)

  @classmethod
  def resolve(cls, model_cfg, *, vocab_size: int, seq_len: int) -> "LlamaModel":
    return cls(resolve_config(model_cfg, vocab_size=vocab_size, seq_len=seq_len))

  @classmethod
  def from_preset(cls, preset: str, *, vocab_size: int, seq_len: int) -> "LlamaModel":
    return cls(LlamaConfig(vocab_size=vocab_size, max_seq_len=seq_len, **PRESETS[preset]))

  def with_batch_axis(self, axis: str | None) -> "LlamaModel":
    return LlamaModel(dataclasses.replace(self.config, batch_axis=axis))

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_seq_len(self) -> int:
    return self.config.max_seq_len

  def init(self, rng, tokens_BxL):
    return self.module.init(rng, tokens_BxL)["params"]

  def apply(self, params, tokens_BxL):
    return self.module.apply({"params": params}, tokens_BxL)

  def embed(self, params, tokens_BxL):
    return self.module.apply({"params": {"embed": params["embed"]}}, tokens_BxL, method=Llama.embed_tokens)

  def blocks(self, params, x_BxLxD):
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]  # all of them, or one stage's slice
    return Layers(self.config, num_layers).apply({"params": params["layers"]}, x_BxLxD)

  def head(self, params, x_BxLxD):
    ends = {"final_norm": params["final_norm"], "head": params["head"]}
    return self.module.apply({"params": ends}, x_BxLxD, method=Llama.logits)

  def loss(self, params, tokens_BxL, targets_BxL):
    return self.module.apply({"params": params}, tokens_BxL, targets_BxL, method=Llama.next_token_loss)

  def head_loss(self, params, x_BxLxD, targets_BxL):
    ends = {"final_norm": params["final_norm"], "head": params["head"]}
    return self.module.apply({"params": ends}, x_BxLxD, targets_BxL, method=Llama.head_loss)

  def num_params(self) -> int:
    return num_params(self.config)

  def flops_per_token(self, seq_len: int) -> float:
    c = self.config
    matmul = c.num_layers * (4 * c.d_model * c.d_model + 3 * c.d_model * c.mlp_dim) + c.d_model * c.vocab_size
    return 6.0 * matmul + 12.0 * c.num_layers * c.d_model * seq_len
