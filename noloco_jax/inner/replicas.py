"""How a device runs the k replicas it holds: batched (vmap) or one after another (a loop).

    vmap        one program over the stacked replicas: every operation gets a leading replica axis.
    sequential  `jax.lax.map`: a loop inside the same program whose body is ONE replica's computation at
                the one-replica shapes (equal to the plain single-replica program to float32 rounding,
                tests/test_inner.py). The inner step loops only over the gradient and vmaps the
                optimizer update (inner/step.py).
    auto        `sequential` on CPU, `vmap` on every other backend (GPU, TPU), when k > 1.

With k = 1 (the default job) the step is built with vmap, so its program is what it was before this
choice existed. Why `auto` picks by platform (experiments/RESULTS.md: "Inner step" and "Accelerator
check"): on XLA:CPU the loop runs 1.10x vmap's throughput; on an H200 vmap ran 4 replicas'
step in 0.71 of the loop's time (a small replica's kernels leave an accelerator idle). The loop's one
advantage there is memory (one replica's activations at a time): set `sequential` when k replicas'
activations do not fit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from noloco_jax.config import inner as config_inner

MODES = config_inner.REPLICA_MAPS  # ("auto", "vmap", "sequential")


def resolve(mode: str, replicas_per_device: int, platform: str | None = None) -> str:
  """The mode the step is built with: `vmap` or `sequential` (see the module docstring)."""
  if mode not in MODES:
    raise ValueError(f"inner.replica_map={mode!r} is not valid: one of {MODES}.")
  if replicas_per_device == 1:
    return "vmap"  # the same computation either way; vmap keeps the program of before
  if mode != "auto":
    return mode
  return "sequential" if (platform or jax.default_backend()) == "cpu" else "vmap"


def over_replicas(fn: Callable, mode: str, in_axes: Sequence[int | None] | None = None) -> Callable:
  """`fn` (one replica's arguments -> one replica's outputs) over a leading replica axis.

  `mode` is a resolved one (`vmap` or `sequential`). `in_axes`, one entry per positional argument,
  is 0 (stacked over replicas) or None (shared by all replicas); default: all 0. Outputs are
  stacked over replicas in either mode.
  """
  if mode == "vmap":
    return jax.vmap(fn, in_axes=tuple(in_axes) if in_axes is not None else 0)
  if mode != "sequential":
    raise ValueError(f"replica map {mode!r} is not one of vmap, sequential (resolve 'auto' first with "
                     "replicas.resolve).")

  def looped(*args):
    axes = tuple(in_axes) if in_axes is not None else (0,) * len(args)
    if len(axes) != len(args) or any(a not in (0, None) for a in axes):
      raise ValueError(f"in_axes={in_axes!r}: one entry per argument ({len(args)}), each 0 or None.")
    stacked = tuple(a for a, axis in zip(args, axes) if axis == 0)

    def one(sliced):
      it = iter(sliced)
      return fn(*(next(it) if axis == 0 else a for a, axis in zip(args, axes)))

    # A while loop over the replicas: its body is compiled once, at one replica's shapes.
    return jax.lax.map(one, stacked)

  return looped
