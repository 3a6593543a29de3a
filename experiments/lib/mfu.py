"""Model FLOPs utilisation: the devices' peak rates, and achieved model FLOP/s over them.

FLOPs per token come from the model (`Model.flops_per_token`, convention in noloco_jax/models/base.py):
6·N_matmul + 12·n_layers·d_model·seq_len, PaLM's convention (appendix B): N_matmul = the weights used
in matrix products (not the input embedding table, a lookup, nor the norm scales); attention over
the full L × L square (the causal mask's saving is not subtracted); no remat, no elementwise work.
MFU = achieved model FLOPs per second / (devices × the device's dense bf16 peak).
"""

from __future__ import annotations

FLOPS_CONVENTION = ("6*N_matmul + 12*n_layers*d_model*seq_len per token (PaLM appendix B); N_matmul = weights in "
                    "matmuls (no input embedding, no norm scales); attention over the full LxL square (no causal "
                    "halving); no remat, no elementwise work")

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


def mfu(tokens_per_s: float, flops_per_tok: int, peak: float | None, num_devices: int) -> float | None:
  """Achieved model FLOP/s over the devices' peak; None when the peak is unknown."""
  if peak is None:
    return None
  return tokens_per_s * flops_per_tok / (peak * num_devices)
