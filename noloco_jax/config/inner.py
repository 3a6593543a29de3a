"""`config.inner`: the inner optimizer, run by every replica at every step."""

import dataclasses

from noloco_jax.config.fields import Section, at_least, fail, one_of

OPTIMIZERS = ("adam", "adamw")
# How a device runs its replicas (noloco_jax/inner/replicas.py).
REPLICA_MAPS = ("auto", "vmap", "sequential")


@dataclasses.dataclass(frozen=True)
class InnerConfig(Section):
  PATH = "inner"

  optimizer: str = "adam"  # adam | adamw
  lr: float = 3e-3  # Peak learning rate of the inner optimizer.
  warmup_steps: int = 50  # Linear warm-up (reference: 1000 of 25000 steps).
  min_lr_ratio: float = 0.1  # Cosine decay to lr * min_lr_ratio (reference: max/10).
  b1: float = 0.9  # Adam's first-moment decay.
  b2: float = 0.95  # Adam's second-moment decay.
  eps: float = 1e-8  # Adam's epsilon.
  weight_decay: float = 0.0  # Only used by adamw (reference: none).
  grad_clip: float = 1.0  # Global-norm clipping; 0 disables.
  # Gradient accumulation (without pipeline stages): each step's batch_size sequences are processed in
  # this many equal slices, one after another, and their gradients averaged: the same update, with
  # the activation memory of one slice. batch_size must be a multiple of microbatches × fsdp.
  microbatches: int = 1
  # How a device holding several replicas (num_replicas > num_devices) runs their inner steps and
  # evaluations: "vmap" (batched: one program over the stacked replicas), "sequential" (a loop in the
  # same program, one replica at a time, each computed exactly as alone; activation memory of one
  # replica) or "auto" (sequential on CPU, where it was measured faster; vmap on GPU and TPU). Without
  # pipeline stages (the pipeline maps its replicas itself). noloco_jax/inner/replicas.py says why.
  replica_map: str = "auto"

  def check(self) -> None:
    one_of("inner.optimizer", self.optimizer, OPTIMIZERS)
    if not self.lr > 0:
      fail("inner.lr", self.lr, "a number > 0")
    at_least("inner.warmup_steps", self.warmup_steps, 0)
    if not 0 <= self.min_lr_ratio <= 1:
      fail("inner.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        fail(f"inner.{name}", getattr(self, name), "a number in [0, 1)")
    if not self.eps > 0:
      fail("inner.eps", self.eps, "a number > 0")
    if self.weight_decay < 0:
      fail("inner.weight_decay", self.weight_decay, "a number ≥ 0")
    if self.grad_clip < 0:
      fail("inner.grad_clip", self.grad_clip, "a number ≥ 0 (0 disables clipping)")
    at_least("inner.microbatches", self.microbatches, 1)
    one_of("inner.replica_map", self.replica_map, REPLICA_MAPS)
