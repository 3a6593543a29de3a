"""`config.model`: which model, its size (a preset, overridable field by field) and its precision."""

import dataclasses

from noloco_jax.config.fields import Section, at_least, fail, one_of

ARCHS = ("llama",)  # registry keys of the models (noloco_jax/models/)
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

  def size(self, name: str) -> int:
    """d_model / num_layers / num_heads / mlp_dim after the preset: the field, or the preset's if 0."""
    return getattr(self, name) or PRESETS[self.preset][name]

  def check(self) -> None:
    one_of("model.arch", self.arch, ARCHS)
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
