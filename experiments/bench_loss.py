"""The loss alone: value_and_grad of the next-token loss wrt (hidden states, head), three ways, timed
alternately in one process.

  plain    [B, L, V] logits from one matmul, log-softmax (the model's loss with model.loss_chunk=0);
  chunked  models/losses.py: chunks of `--chunk` positions, gradient finished in the forward pass
           by a custom_vjp (model.loss_chunk > 0);
  naive    a lax.scan over the same chunks with jax.checkpoint around each chunk's loss, left to
           autodiff (the first attempt, slower than plain on an H100; kept here only to compare).

Per variant: median step time, its ratio to plain, XLA's temporary bytes of the compiled program, and
the matmuls with the vocabulary as a dimension in the lowered program (a scan body counted once: per
chunk) — the head's FLOPs in units of one logits matmul.

    python experiments/bench_loss.py --json
    python experiments/bench_loss.py --vocab=128002 --batch=8 --seq_len=1024 --d_model=768 --dtype=bfloat16 --json
"""

from __future__ import annotations

import statistics
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--batch", type=int, default=4)
  bench.add_argument("--seq_len", type=int, default=128)
  bench.add_argument("--d_model", type=int, default=128)
  bench.add_argument("--vocab", type=int, default=32768)
  bench.add_argument("--chunk", type=int, default=32, help="sequence positions per chunk")
  bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  bench.add_argument("--steps", type=int, default=5)
  bench.add_argument("--repeats", type=int, default=7)
  args = bench.parse(argv)

  import jax
  import jax.numpy as jnp
  from noloco_jax.models import losses

  B, L, D, V, C = args.batch, args.seq_len, args.d_model, args.vocab, args.chunk
  dtype = jnp.dtype(args.dtype)

  def naive(x, w, t):
    n = L // C
    xs, ts = x.reshape(B, n, C, D).swapaxes(0, 1), t.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_loss(x_c, t_c):
      logits = jnp.einsum("bcd,dv->bcv", x_c, w.astype(x.dtype), preferred_element_type=jnp.float32)
      return jnp.sum(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t_c[..., None], -1)[..., 0])

    total, _ = jax.lax.scan(lambda s, xt: (s + chunk_loss(*xt), None), jnp.zeros((), jnp.float32), (xs, ts))
    return total / (B * L)

  variants = {"plain": losses.plain_cross_entropy,
              "chunked": lambda x, w, t: losses.chunked_cross_entropy(x, w, t, C),
              "naive": naive}
  if L % C:
    raise SystemExit(f"--chunk={C} must divide --seq_len={L} (the naive variant does not pad).")
  kx, kw, kt = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (B, L, D), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (D, V), jnp.float32) * D ** -0.5
  t = jax.random.randint(kt, (B, L), 0, V)

  fns, info = {}, {}
  for name, loss in variants.items():
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    lowered = fn.lower(x, w, t)
    # Matmuls whose result or operands carry the vocabulary: the head's forward and gradient matmuls.
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line and f"{V}" in line]
    compiled = lowered.compile()
    fns[name] = compiled
    info[name] = {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "vocab_matmuls": len(dots)}
    jax.block_until_ready(compiled(x, w, t))

  times = {name: [] for name in fns}
  values = {}
  for _ in range(args.repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        out = fn(x, w, t)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / args.steps)
      values[name] = out

  result = {"benchmark": "bench_loss", "platform": jax.devices()[0].platform, "batch": B, "seq_len": L,
            "d_model": D, "vocab": V, "chunk": C, "dtype": args.dtype, "logits_bytes_f32": 4 * B * L * V}
  for name in fns:
    ratios = [a / p for a, p in zip(times[name], times["plain"])]
    (value, (gx, gw)) = values[name]
    (value_p, (gx_p, gw_p)) = values["plain"]
    result[name] = {"step_s": statistics.median(times[name]), "time_ratio_vs_plain_median": statistics.median(ratios),
                    **info[name], "loss": float(value),
                    "max_abs_diff_vs_plain": {"loss": float(abs(value - value_p)),
                                              "dx": float(jnp.max(jnp.abs(gx.astype(jnp.float32) - gx_p.astype(jnp.float32)))),
                                              "dw": float(jnp.max(jnp.abs(gw - gw_p)))}}

  def text(r):
    return "\n".join(f"{name:8s} {r[name]['step_s'] * 1e3:8.2f} ms  ratio {r[name]['time_ratio_vs_plain_median']:.3f}  "
                     f"temp {r[name]['temp_bytes'] / 2 ** 20:8.1f} MiB  vocab matmuls {r[name]['vocab_matmuls']}"
                     for name in fns)

  return bench.finish(result, text=text)


if __name__ == "__main__":
  harness.run(main)
