"""Byte counts of compiled and lowered programs that only the tests use (the package's own analysis:
noloco_jax/tools/hlo.py)."""

import re

import numpy as np

from noloco_jax.tools import hlo

_STABLEHLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4}


def stablehlo_collective_bytes(mlir_text: str, op: str = "collective_permute") -> int:
  """Operand bytes of `stablehlo.<op>` ops in a lowered program (`jit(f).lower(...).as_text()`): what the
  program asks to send, before XLA's passes (XLA:CPU widens bf16 collectives to f32 after lowering)."""
  total = 0
  for dims, dtype in re.findall(r'"stablehlo\.' + op + r'".*?: \(tensor<([\dx]*?)x?(f32|bf16|f16|i32|ui32)>', mlir_text):
    total += _STABLEHLO_BYTES[dtype] * int(np.prod([int(d) for d in dims.split("x") if d] or [1]))
  return total


def permute_pair_bytes(hlo_text: str) -> int:
  """Σ over the collective-permutes of optimized HLO of operand bytes × (source, target) pairs: the bytes
  all devices together put on the wire. A permute whose pairs cover only some devices (epidemic.py's
  partial matchings) counts only the devices that really send."""
  return sum(nbytes * len(pairs) for op, nbytes, pairs in hlo.collectives(hlo_text) if op == "collective-permute")
