"""Bytes that a compiled program puts into collectives, read from its HLO text.

Used by the tests (counted bytes = compiled bytes) and experiments/bench_outer.py. Only what XLA
actually emitted counts: a collective the compiler removed or merged is seen as it really runs.

`collective_bytes(hlo, op)` sums the *operand* bytes of every `op` instruction (sync, or the `-start`
half of an async pair). Operands, not results: an async `collective-permute-start` returns a tuple
(input, output, contexts) whose size is twice the message, while its operand is the message itself.
For `collective-permute`, an operand's bytes are what each source device sends; for `all-reduce`,
what each device contributes (a ring all-reduce moves ≈ 2·(D−1)/D times that over each device's link).

Operand bytes are not bytes on the wire: `wire_bytes` turns every collective of a program into what
each device sends and receives under a named algorithm, with the formulas of noloco_jax/outer/wire.py
(the same ones the training metrics use), so that a method's wire figures can be checked against the
program XLA really compiled (tests/test_wire.py) and the dry run can print both.

Caveat: XLA:CPU widens bf16 collectives to f32 after lowering, so a bf16 message shows up as f32
in the CPU-compiled program (the tests read the lowered, pre-XLA program where that matters:
tests/hlo_helpers.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from noloco_jax.outer import wire

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
         "f32": 4, "s64": 8, "u64": 8, "f64": 8}
OPS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_SHAPE = re.compile(r"\b(" + "|".join(BYTES) + r")\[([\d,]*)\]")


def shape_bytes(text: str) -> int:
  """Bytes of every `dtype[d0,d1,...]` shape written in `text`."""
  return sum(BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dtype, dims in _SHAPE.findall(text))


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")


def _operand_text(line: str, start: int) -> str:
  """The text between the parenthesis at `start` and its matching close."""
  depth = 0
  for i in range(start, len(line)):
    depth += {"(": 1, ")": -1}.get(line[i], 0)
    if depth == 0:
      return line[start + 1:i]
  return line[start + 1:]


def _instructions(hlo_text: str):
  """(name without %, result shape, opcode, operand text) of each instruction line of HLO text."""
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      name, shape, opcode = m.groups()
      yield name.lstrip("%"), shape, opcode, _operand_text(line, m.end() - 1)


def collective_ops(hlo_text: str, op: str) -> list[int]:
  """Operand bytes of each `op` instruction (or `op-start`) in optimized HLO text, in program order.

  Recent XLA prints operands by name only (`collective-permute(%param.2)`), so each operand's shape is
  looked up from the instruction that defines it (names are unique within an HLO module); operands
  printed with their shape (older printers) are read directly.
  """
  result_shape, found = {}, []
  for name, shape, opcode, operands in _instructions(hlo_text):
    result_shape[name] = shape
    if opcode in (op, op + "-start"):
      found.append(operands)
  sizes = []
  for operands in found:
    if _SHAPE.search(operands):
      sizes.append(shape_bytes(operands))
    else:
      names = re.findall(r"%?([\w.\-]+)", operands)
      sizes.append(sum(shape_bytes(result_shape[n]) for n in names if n in result_shape))
  return sizes


def collective_bytes(hlo_text: str, op: str) -> int:
  """Sum of the operand bytes of all `op` instructions (e.g. "collective-permute", "all-reduce")."""
  return sum(collective_ops(hlo_text, op))


def all_collective_bytes(hlo_text: str) -> dict[str, int]:
  """{op: operand bytes} for every collective kind present in the program."""
  out = {op: collective_bytes(hlo_text, op) for op in OPS}
  return {op: b for op, b in out.items() if b}


def bytes_accessed(compiled) -> float:
  """Bytes a compiled program reads and writes (per device for an SPMD program), by XLA's cost analysis:
  every instruction's operands and results; a fusion counts only what enters and leaves it. A program
  with nothing to compute (its outputs alias its inputs) reports none."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get("bytes accessed", 0.0))


def parameter_copies(hlo_text: str) -> int:
  """Bytes of the program's parameters that it copies (`copy` instructions of the entry computation whose
  operand is an entry parameter): buffers XLA could not update in place, typically a donated input still
  read after the output that reuses its buffer is written. Each costs its bytes twice in `bytes_accessed`
  (read and written) for no arithmetic. Copies of computed values (a value returned as two outputs, such as
  θ ← φ) are not counted: every output has a buffer of its own."""
  entry = hlo_text[hlo_text.index("ENTRY"):] if "ENTRY" in hlo_text else hlo_text
  opcode, total = {}, 0
  for name, shape, op, operands in _instructions(entry):
    opcode[name] = op
    if op == "copy":
      operand = re.findall(r"%?([\w.\-]+)", operands)
      if operand and opcode.get(operand[0]) == "parameter":
        total += shape_bytes(shape)
  return total


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


# ---- Who talks to whom: the device groups of each collective (tests of "no global barrier") ----

_GROUPS = re.compile(r"replica_groups=(\{[\d,{}\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


def _iota_groups(text: str) -> list[tuple[int, ...]]:
  """`[G,S]<=[dims]T(perm)`: iota(prod dims).reshape(dims).transpose(perm).reshape(G, S), as rows."""
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  shape, dims = [int(d) for d in m.group(1).split(",")], [int(d) for d in m.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(d) for d in m.group(3).split(",")])
  return [tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1)]


def collective_groups(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
  """(op, groups) of every collective in optimized HLO text, in program order.

  For `collective-permute` the groups are its (source, target) pairs; for the others, its
  replica_groups (explicit `{{0,1},{2,3}}` or iota `[2,2]<=[4]`), `[]` meaning all devices. The ids
  are the program's device (partition) ids, i.e. positions in the mesh's device order.
  """
  found = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    opcode = m.group(3).removesuffix("-start")
    if opcode not in OPS:
      continue
    if opcode == "collective-permute":
      pairs = _PAIRS.search(line)
      groups = [tuple(int(i) for i in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))] if pairs else []
    else:
      g = _GROUPS.search(line)
      if g is None or g.group(1) in ("{}", "{{}}"):
        groups = []
      elif g.group(1).startswith("["):
        groups = _iota_groups(g.group(1))
      else:
        groups = [tuple(int(i) for i in grp.split(",") if i) for grp in re.findall(r"\{([\d,]*)\}", g.group(1))]
    found.append((opcode, groups))
  return found


# ---- Bytes on the wire of every collective (outer/wire.py's formulas) ----


def collectives(hlo_text: str) -> list[tuple[str, int, list[tuple[int, ...]]]]:
  """(op, operand bytes per device, groups) of every collective in program order (see
  `collective_ops` and `collective_groups`)."""
  ops = collective_groups(hlo_text)
  sizes = {op: iter(collective_ops(hlo_text, op)) for op in OPS}
  return [(op, next(sizes[op]), groups) for op, groups in ops]


@dataclasses.dataclass(frozen=True)
class Wire:
  """Per-device bytes of a program's collectives, as arrays over the program's devices."""
  sent: np.ndarray
  received: np.ndarray
  operand: np.ndarray


def wire_bytes(hlo_text: str, num_devices: int, algorithm: str = "ring", block: int = 1) -> dict[str, Wire]:
  """What each device sends, receives and puts into collective operands, split into collectives that
  stay within one block of `block` consecutive devices ("within": a replica's own fsdp or stage
  devices) and those that cross blocks ("across": between replicas).

  collective-permute: each (source, target) pair sends the operand once. all-reduce, all-gather,
  reduce-scatter, all-to-all: every member of each replica group (no groups: all devices) sends and
  receives what outer/wire.py says for a group of that size (an all-gather's operand is one member's
  share). A tree all-reduce's bytes differ by position in the tree: each member gets the mean.
  """
  out = {side: Wire(np.zeros(num_devices), np.zeros(num_devices), np.zeros(num_devices, np.int64))
         for side in ("within", "across")}
  for op, nbytes, groups in collectives(hlo_text):
    if op == "collective-permute":
      for source, target in groups:
        side = out["within" if source // block == target // block else "across"]
        side.sent[source] += nbytes
        side.received[target] += nbytes
        side.operand[source] += nbytes
      continue
    for group in groups or [tuple(range(num_devices))]:
      g = len(group)
      if op == "all-reduce":
        traffic = wire.allreduce(nbytes, g, algorithm)
      elif op == "all-gather":
        traffic = wire.allgather(nbytes * g, g)
      elif op == "reduce-scatter":
        traffic = wire.reduce_scatter(nbytes, g)
      else:  # all-to-all: every member keeps 1/g of its operand and sends the rest, one chunk per peer
        traffic = wire.Traffic(sent=(g - 1) / g * nbytes, received=(g - 1) / g * nbytes, operand=nbytes)
      side = out["within" if len({d // block for d in group}) == 1 else "across"]
      for d in group:
        side.sent[d] += traffic.sent
        side.received[d] += traffic.received
        side.operand[d] += nbytes
  return out
