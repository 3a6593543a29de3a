"""Attention alone: forward + backward of each implementation (models/attention.py), timed alternately.

Per implementation: median time of the jitted gradient of sum(attention(q, k, v)²) wrt q, k, v, and
its median time ratio to `einsum` (the reference). `cudnn` runs only on an NVIDIA GPU with bf16/fp16.

    python experiments/bench_attention.py --json                 # the default job's shapes (B 4, L 128, 4 × 32)
    python experiments/bench_attention.py --batch=8 --seq_len=1024 --heads=12 --head_dim=64 --dtype=bfloat16 \
        --impl=einsum --impl=xla --impl=cudnn --json             # the paper's small model on a GPU
"""

from __future__ import annotations

import statistics
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--batch", type=int, default=4)
  bench.add_argument("--seq_len", type=int, default=128)
  bench.add_argument("--heads", type=int, default=4)
  bench.add_argument("--kv_heads", type=int, default=0, help="key/value heads (0 = --heads)")
  bench.add_argument("--head_dim", type=int, default=32)
  bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  bench.add_argument("--impl", action="append", default=[], help="implementations (default einsum, xla)")
  bench.add_argument("--steps", type=int, default=10)
  bench.add_argument("--repeats", type=int, default=20)
  args = bench.parse(argv)
  import jax
  import jax.numpy as jnp
  from noloco_jax.models import attention

  impls = args.impl or ["einsum", "xla"]
  B, L, N, G, H = args.batch, args.seq_len, args.heads, args.kv_heads or args.heads, args.head_dim
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, L, N, H), args.dtype)
  k, v = (jax.random.normal(key, (B, L, G, H), args.dtype) for key in keys[1:])
  fns = {}
  for impl in impls:
    loss = lambda q, k, v, impl=impl: jnp.sum(attention.causal_attention(q, k, v, impl).astype(jnp.float32) ** 2)
    fns[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(fns[impl](q, k, v))
  times = {impl: [] for impl in impls}
  for _ in range(args.repeats):
    for impl, fn in fns.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        out = fn(q, k, v)
      jax.block_until_ready(out)
      times[impl].append((time.perf_counter() - start) / args.steps)
  result = {"benchmark": "bench_attention", "platform": jax.devices()[0].platform, "batch": B, "seq_len": L,
            "heads": N, "kv_heads": G, "head_dim": H, "dtype": args.dtype}
  for impl in impls:
    entry = {"step_s": statistics.median(times[impl])}
    if "einsum" in times:
      entry["time_ratio_vs_einsum_median"] = statistics.median(a / e for a, e in zip(times[impl], times["einsum"]))
    result[impl] = entry
  return bench.finish(result, text=lambda r: "\n".join(
      f"{impl:7s} {r[impl]['step_s'] * 1e3:8.2f} ms  ratio {r[impl].get('time_ratio_vs_einsum_median')}" for impl in impls))


if __name__ == "__main__":
  harness.run(main)
