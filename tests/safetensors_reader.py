"""A plain reader of the safetensors files export_hf writes: the tests' check of its output (the reference
reader, the `safetensors` package, is checked beside it where installed: tests/test_export_hf.py)."""

import json
import struct

import numpy as np

from noloco_jax import export_hf


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """The inverse of export_hf.write_safetensors (any safetensors file of these dtypes)."""
  codes = {code: np.dtype(export_hf.DTYPES[name]) if name in export_hf.DTYPES else np.dtype(name)
           for name, code in export_hf.SAFETENSORS_DTYPES.items()}
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    data = f.read()
  header.pop("__metadata__", None)
  return {name: np.frombuffer(data[h["data_offsets"][0]:h["data_offsets"][1]], dtype=codes[h["dtype"]]).reshape(h["shape"])
          for name, h in header.items()}
