"""Model FLOPs utilisation: the model's FLOPs per token, and the devices' peak rates to divide by.

Convention (PaLM, Chowdhery et al. 2022, appendix B), training FLOPs per token:

    6 · N  +  12 · n_layers · d_model · seq_len

N counts every parameter except the input embedding table (a lookup, not a matmul): the layers, the
final norm and the output head. 6 = 2 FLOPs per multiply-add × (1 forward + 2 backward matmuls). The
second term is attention's two matmuls (q·kᵀ and probabilities·v: 2 · 2 · seq_len · d_model per layer
forward, × 3 for training), counted over the full L × L square: the causal mask's saving is NOT
subtracted, and neither are recomputation (remat) nor elementwise work counted. MFU is then
achieved model FLOPs per second / (devices × the device's dense bf16 peak).
"""

from __future__ import annotations

from noloco_jax.models import llama as model_lib

FLOPS_CONVENTION = ("6*N + 12*n_layers*d_model*seq_len per token (PaLM appendix B); N = parameters without the "
                    "input embedding; attention over the full LxL square (no causal halving); no remat, no "
                    "elementwise work")

# Dense bfloat16 peak FLOP/s per device, by a substring of jax.Device.device_kind (first match wins:
# more specific names first). H100 is the SXM part (the PCIe card's peak is lower, 756 TFLOP/s).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p reports itself as "TPU v5"
    ("TPU v4", 275e12),
)


def peak_flops(device_kind: str, platform: str) -> float | None:
  """The device's dense bf16 peak in FLOP/s, or None (CPU, or a device not in the table)."""
  if platform == "cpu":
    return None
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None


def flops_per_token(cfg: model_lib.LlamaConfig, seq_len: int) -> int:
  """Training FLOPs per token under FLOPS_CONVENTION."""
  n = model_lib.num_params(cfg) - cfg.vocab_size * cfg.d_model  # without the input embedding
  return 6 * n + 12 * cfg.num_layers * cfg.d_model * seq_len


def mfu(tokens_per_s: float, flops_per_tok: int, peak: float | None, num_devices: int) -> float | None:
  """Achieved model FLOP/s over the devices' peak; None when the peak is unknown."""
  if peak is None:
    return None
  return tokens_per_s * flops_per_tok / (peak * num_devices)
