"""`config.model`: which model, its size (a preset, overridable field by field) and its precision."""

import dataclasses

from noloco_jax.config.fields import Section, at_least, fail, one_of

# Registry keys of the models (noloco_jax/models/). The schema sits below the models in the import graph,
# so a model registered at run time (models.register) adds its key here through `register_arch`.
ARCHS: list[str] = ["llama"]
DTYPES = ("float32", "bfloat16")
# Llama sizes: hidden / layers / heads / MLP (the NoLoCo paper's 125M / 1.3B / 6.8B models and a tiny
# one for CPUs). `small` uses 12 heads as the reference code does (the paper says 16).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, num_layers=2, num_heads=4, mlp_dim=384),
    "small": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "medium": dict(d_model=2048, num_layers=24, num_heads=32, mlp_dim=8192),
    "large": dict(d_model=4096, num_layers=32, num_heads=32, mlp_dim=16384),
}
SIZE_FIELDS = ("d_model", "num_layers", "num_heads", "mlp_dim")
# Attention kernels (noloco_jax/models/attention.py) and remat policies (models/llama.py: REMAT_POLICIES).
ATTENTIONS = ("auto", "xla", "cudnn", "einsum")
REMAT_POLICIES = ("nothing", "dots")


def register_arch(arch: str) -> None:
  """Makes `arch` a valid config.model.arch (called by noloco_jax.models.register)."""
  if arch not in ARCHS:
    ARCHS.append(arch)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
  PATH = "model"

  arch: str = "llama"  # Which model: its registry key (ARCHS). Llama: a decoder (noloco_jax/models/llama.py).
  preset: str = "tiny"  # Size: tiny | small | medium | large (PRESETS above).
  # Size fields: 0 = take it from the preset; any positive value overrides the preset.
  d_model: int = 0
  num_layers: int = 0
  num_heads: int = 0
  mlp_dim: int = 0
  vocab_size: int = 0  # 0 = the tokenizer's vocabulary size.
  max_seq_len: int = 0  # 0 = data.seq_len.
  rope_theta: float = 10_000.0  # Base of the rotary position embedding's frequencies.
  norm_eps: float = 1e-6  # RMSNorm's epsilon.
  param_dtype: str = "float32"  # Storage dtype of the weights: float32 | bfloat16.
  dtype: str = "float32"  # Compute dtype (matmuls, activations): float32 | bfloat16.
  # Recompute each layer's activations in the backward pass instead of storing them: activation
  # memory falls from O(layers) to O(1) layers, for about one extra forward pass of compute.
  remat: bool = False
  # With remat, what a layer keeps for its backward pass: "nothing" (its input only) or "dots" (also its
  # weight matmuls' outputs, jax.checkpoint_policies.dots_with_no_batch_dims_saveable: less
  # recomputation, more memory).
  remat_policy: str = "nothing"
  # Attention kernel: auto (cuDNN flash attention on NVIDIA GPUs with bf16 compute, einsum on CPU, XLA
  # elsewhere) | xla | cudnn (bf16 only) | einsum (the original einsum/softmax, the reference).
  attention: str = "auto"
  # The loss over the vocabulary in chunks of this many sequence positions (each chunk: batch × this
  # many tokens), never holding the [B, L, V] float32 logits (noloco_jax/models/losses.py); 0 = the
  # plain loss. For large vocabularies.
  loss_chunk: int = 0

  def size(self, name: str) -> int:
    """d_model / num_layers / num_heads / mlp_dim after the preset: the field, or the preset's if 0."""
    return getattr(self, name) or PRESETS[self.preset][name]

  def check(self) -> None:
    one_of("model.arch", self.arch, tuple(ARCHS))
    one_of("model.preset", self.preset, tuple(PRESETS))
    for name in SIZE_FIELDS + ("vocab_size", "max_seq_len"):
      at_least(f"model.{name}", getattr(self, name), 0)
    for name in ("dtype", "param_dtype"):
      one_of(f"model.{name}", getattr(self, name), DTYPES)
    d_model, heads = self.size("d_model"), self.size("num_heads")
    if d_model % heads or (d_model // heads) % 2:
      fail("model.num_heads", heads, f"a divisor of d_model={d_model} leaving an even head dimension (for RoPE)")
    for name in ("rope_theta", "norm_eps"):
      if not getattr(self, name) > 0:
        fail(f"model.{name}", getattr(self, name), "a number > 0")
    one_of("model.remat_policy", self.remat_policy, REMAT_POLICIES)
    one_of("model.attention", self.attention, ATTENTIONS)
    if self.attention == "cudnn" and self.dtype != "bfloat16":
      fail("model.attention", self.attention, "'cudnn' only with model.dtype='bfloat16' (cuDNN's fused attention "
           "takes bf16/fp16); use 'auto', 'xla' or 'einsum' for float32 compute")
    at_least("model.loss_chunk", self.loss_chunk, 0)
