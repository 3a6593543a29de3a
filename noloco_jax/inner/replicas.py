"""How a device runs the k replicas it holds: batched (vmap) or one after another (a loop).

    vmap        one program over the stacked replicas: every operation of the step gets a leading
                replica axis (k times larger matmuls, softmaxes, Adam passes).
    sequential  `jax.lax.map`: a loop inside the same compiled program, whose body is ONE replica's
                computation at the one-replica shapes. Each replica's result equals what the plain
                single-replica program computes, to float32 rounding (tests/test_inner.py). The inner
                step loops only over the gradient and vmaps the optimizer update (inner/step.py).
    auto        `sequential` on CPU, `vmap` on every other backend (GPU, TPU), when k > 1.

With one replica per device (k = 1, e.g. the default job: 8 replicas on 8 devices) both are the same
computation and the step is built with vmap, so that its program stays exactly what it was before
this choice existed.

Why `auto` loops on CPU (measured; experiments/RESULTS.md, "Replicas that vmap well"): on XLA:CPU the
vmapped step of 8 tiny-Llama replicas on one device runs at 0.55-0.66 of the throughput of 8
separate single-replica steps (issue 26 traced most of the loss to attention under vmap). The loop
needs no operation to vmap well: its body is one replica's forward and backward, and the step runs at
1.02-1.03x the throughput of the k separate calls on a quiet 2-core machine (1.10x vmap's; 1.4-1.5x
vmap's on a loaded one).

Why `auto` batches elsewhere (expected, NOT measured: no GPU was available): an accelerator is fed by
few large kernels, and a small replica's kernels leave most of it idle; vmap gives each kernel k times
the work. A loop also serialises the replicas on the device. Its one advantage there is memory: the
loop holds one replica's activations at a time, vmap k replicas' (set `sequential` when k replicas'
activations do not fit; both hold the k replicas' gradients at once, for the batched update).
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
