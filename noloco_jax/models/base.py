"""The model interface: everything the trainer, the pipeline, the dry run and the latency model ask of a model.

A model is a decoder over token ids that returns next-token logits. To add one, subclass `Model` in a
module of its own (llama.py is the first), register it in models/__init__.py (or with
`models.register` from outside the package) and select it with `config.model.arch`. Nothing else
names a model: the inner step calls `apply`, the pipeline calls `embed` / `blocks` / `head` on the
parameters each stage owns (`stage_role`), the dry run and the summary call `num_params`, the latency
model calls `from_preset(...).num_params()`.

Parameters are a pytree of arrays (flax's {"params": ...} content, without the wrapper). For the
pipeline, the layers that `blocks` runs must be stacked on a leading layer axis under one top-level
collection whose role is "layers", so that a stage can hold a contiguous slice of them; the other
top-level collections are owned by the first stage (role "first": the embedding) or the last
("last": final norm and head).

FLOPs convention (`flops_per_token`): training FLOPs per token = 6·N_matmul + 12·layers·d_model·L.
N_matmul counts the weights used in matrix products (every parameter but the input embedding table,
a lookup, and the norm scales, elementwise); 6 = 2 (multiply-add) × 3 (forward, and a backward
pass twice as costly). The second term is the attention scores and the weighted sum of values
(QKᵀ and AV: 2 matmuls × 2 FLOPs × d_model × L per token and layer, × 3 for the backward pass),
counted over the full L×L square although the causal mask discards half of it (PaLM's convention).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp

from noloco_jax.models import losses

# Names of the dtypes a config may give (model.dtype, model.param_dtype, outer.state_dtype).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Model(abc.ABC):
  """One architecture with its resolved sizes. Immutable; `with_batch_axis` returns a copy."""

  arch: ClassVar[str]  # the name config.model.arch selects
  # Top-level parameter collection -> "first" | "layers" | "last" (exactly one "layers").
  stage_roles: ClassVar[dict[str, str]]

  # ---- config resolution ----

  @classmethod
  @abc.abstractmethod
  def resolve(cls, model_cfg, *, vocab_size: int, seq_len: int) -> "Model":
    """The model `config.model` describes, for a vocabulary and a training sequence length."""

  @classmethod
  @abc.abstractmethod
  def from_preset(cls, preset: str, *, vocab_size: int, seq_len: int) -> "Model":
    """A named size with default everything else (the latency model's paper sizes)."""

  @abc.abstractmethod
  def with_batch_axis(self, axis: str | None) -> "Model":
    """The same model pinning its activations' batch dimension to mesh axis `axis` (fsdp; None = free)."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    ...

  @property
  @abc.abstractmethod
  def max_seq_len(self) -> int:
    ...

  # ---- the network ----

  @abc.abstractmethod
  def init(self, rng: jax.Array, tokens_BxL: jax.Array) -> Any:
    """Fresh parameters of one replica (their shapes may not depend on the batch)."""

  @abc.abstractmethod
  def apply(self, params: Any, tokens_BxL: jax.Array) -> jax.Array:
    """float32 next-token logits [B, L, V]: head(blocks(embed(tokens)))."""

  @abc.abstractmethod
  def embed(self, params: Any, tokens_BxL: jax.Array) -> jax.Array:
    """The first stage's part: token ids -> activations [B, L, D]. Reads only "first" parameters."""

  @abc.abstractmethod
  def blocks(self, params: Any, x_BxLxD: jax.Array) -> jax.Array:
    """Runs every layer stacked in the "layers" collection of `params`: all of them, or a stage's slice."""

  @abc.abstractmethod
  def head(self, params: Any, x_BxLxD: jax.Array) -> jax.Array:
    """The last stage's part: activations -> float32 logits [B, L, V]. Reads only "last" parameters."""

  # ---- the loss: what the inner step and the pipeline's last stage call ----

  def loss(self, params: Any, tokens_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats). By default from `apply`'s logits; a model may override it
    to avoid materialising them (Llama with model.loss_chunk: models/losses.py)."""
    return losses.cross_entropy(self.apply(params, tokens_BxL), targets_BxL)

  def head_loss(self, params: Any, x_BxLxD: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """`loss` from the last layer's activations: the pipeline's last stage. Reads only "last" parameters."""
    return losses.cross_entropy(self.head(params, x_BxLxD), targets_BxL)

  # ---- sizes ----

  @abc.abstractmethod
  def num_params(self) -> int:
    """Parameters of one replica (analytic; a test checks it against `init`)."""

  @abc.abstractmethod
  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token at sequence length `seq_len` (convention: module docstring)."""

  # ---- what the pipeline needs: shared by every model ----

  def stage_role(self, path: Sequence[Any]) -> str:
    """"first" | "layers" | "last" for a leaf of the params or of any tree holding them (optimizer
    moments, φ, δ), from the first dict key on its path that names a top-level collection; "other"
    for leaves outside the parameters (step counters)."""
    for key in path:
      name = getattr(key, "key", None)
      if name in self.stage_roles:
        return self.stage_roles[name]
    return "other"
