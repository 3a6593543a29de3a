"""Where one replica's training step goes: gradients vs optimizer, and what the float32 copies cost.

For one replica of the configured model (no mesh: a plain jitted program per part), prints JSON with,
per part, XLA's cost analysis of the compiled program (flops, bytes accessed) and its measured median
time, the parts timed alternately:
  step       value_and_grad + clipping + Adam update (what the inner step runs per replica)
  grads      value_and_grad only
  optimizer  clipping + Adam update only (given gradients)
and, for the gradient program, the element-type conversions in the optimized HLO (the float32 copies
RMSNorm and RoPE make of bf16 activations) with the bytes they write.

    python experiments/profile_step.py --json                                  # the default job's model
    python experiments/profile_step.py --config.model.dtype=bfloat16 --json    # bf16 compute
    python experiments/profile_step.py --config.model.remat=True --config.model.remat_policy=dots --json
"""

from __future__ import annotations

import re
import statistics
import time

from experiments.lib import harness

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "f64": 8}


def convert_bytes(hlo_text: str) -> dict:
  """`convert` instructions in optimized HLO, by target type: all of them, and those outside fusions.

  A convert inside a fused computation is computed on the fly as part of its fusion; one outside
  writes a converted copy to memory. The bytes are those of the converts' results.
  """
  out: dict = {}
  fused = False
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
    if header:
      fused = "fused" in header.group(2) or "fusion" in header.group(2)
      continue
    m = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} convert\(", line)
    if not m:
      continue
    n = 1
    for d in filter(None, m.group(2).split(",")):
      n *= int(d)
    entry = out.setdefault(m.group(1), {"count": 0, "bytes": 0, "unfused_count": 0, "unfused_bytes": 0})
    entry["count"] += 1
    entry["bytes"] += n * _BYTES.get(m.group(1), 4)
    if not fused:
      entry["unfused_count"] += 1
      entry["unfused_bytes"] += n * _BYTES.get(m.group(1), 4)
  return out


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True)
  bench.add_argument("--steps", type=int, default=5)
  bench.add_argument("--repeats", type=int, default=5)
  args = bench.parse(argv)
  import jax
  import numpy as np
  from noloco_jax import models
  from noloco_jax.inner import step as inner
  from noloco_jax.inner.state import TrainState

  cfg = bench.override(bench.config())
  vocab = cfg.model.vocab_size or 257
  model = models.get(cfg.model.arch).resolve(cfg.model, vocab_size=vocab, seq_len=cfg.data.seq_len)
  batch = np.random.default_rng(0).integers(0, vocab, (cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
  params = model.init(jax.random.key(0), batch[:1, :-1])
  optimizer = inner.make_optimizer(cfg.inner, cfg.num_steps)
  state = TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params, opt_state=optimizer.init(params),
                     outer=())
  grads0 = jax.tree.map(lambda p: p * 1e-3, params)

  def full(s, b):
    loss, grads = inner.compute_grads(s.params, b, model.loss)
    return inner.apply_grads(s, grads, optimizer), loss

  parts = {
      "step": (jax.jit(full), (state, batch)),
      "grads": (jax.jit(lambda p, b: inner.compute_grads(p, b, model.loss)), (params, batch)),
      "optimizer": (jax.jit(lambda s, g: inner.apply_grads(s, g, optimizer)), (state, grads0)),
  }
  result = {"benchmark": "profile_step", "platform": jax.devices()[0].platform, "overrides": bench.overrides(),
            "num_params": model.num_params(), "batch": cfg.data.batch_size, "seq_len": cfg.data.seq_len}
  compiled = {}
  for name, (fn, fn_args) in parts.items():
    c = fn.lower(*fn_args).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    compiled[name] = c
    result[name] = {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
                    "temp_bytes": c.memory_analysis().temp_size_in_bytes, "times": []}
    jax.block_until_ready(c(*fn_args))
  result["grads"]["converts"] = convert_bytes(compiled["grads"].as_text())
  result["param_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  for _ in range(args.repeats):
    for name, (_, fn_args) in parts.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        out = compiled[name](*fn_args)
      jax.block_until_ready(out)
      result[name]["times"].append((time.perf_counter() - start) / args.steps)
  for name in parts:
    result[name]["step_s"] = statistics.median(result[name]["times"])
  result["optimizer_share_of_step"] = result["optimizer"]["step_s"] / result["step"]["step_s"]
  return bench.finish(result, text=lambda r: "\n".join(
      f"{name:10s} {r[name]['step_s'] * 1e3:8.2f} ms  {r[name]['flops'] / 1e9:8.3f} GFLOP  "
      f"{r[name]['bytes_accessed'] / 2**20:8.1f} MiB" for name in parts))


if __name__ == "__main__":
  harness.run(main)
