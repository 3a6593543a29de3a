"""Step time, tokens/s, MFU and peak device memory of the training step, against a plain jitted step.

Two programs on the same model and per-replica batch, timed alternately in one process:
  mapped: the project's inner step (shard_map over `replica`, vmap over the k replicas each device
          holds) advancing devices × k replicas;
  plain:  one replica's value_and_grad + optimizer update under a bare jax.jit on one device (no mesh,
          no vmap): what the model and loss cost by themselves.

FLOPs per token are the model's (`Model.flops_per_token`; printed as `flops_convention`); MFU divides by the
device's dense bf16 peak (null on CPU or an unknown device). Memory, per program:
  peak_bytes_in_use   measured: jax.Device.memory_stats()["peak_bytes_in_use"] of the first device
                      (null where the backend keeps no statistics, e.g. CPU). A process-wide high-water
                      mark: plain runs first, so its figure is its own; mapped's is max(plain, mapped).
  predicted_peak_bytes  the dry run's quantity for the same compiled program (arguments + outputs −
                      aliased + temporaries, from compiled.memory_analysis(); noloco_jax/tools/dryrun.py).

    python experiments/bench_mfu.py --json                                  # default job's model, 1 replica
    python experiments/bench_mfu.py --preset=small --vocab=128002 --batch=8 --seq_len=1024 \
        --config.model.dtype=bfloat16 --json                               # the paper's small row, 1 GPU
    python experiments/bench_mfu.py --preset=small --replicas_per_device=4 --batch=8 --seq_len=1024 ...
    python experiments/bench_mfu.py --config=configs/default.py:smoke --steps=2 --repeats=1 --json   # seconds on CPU
"""

from __future__ import annotations

import statistics
import time

from experiments.lib import harness


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True, cpu_devices=lambda args: args.devices)
  bench.add_argument("--preset", default="", help="model preset: tiny | small | medium | large")
  bench.add_argument("--vocab", type=int, default=0, help="vocabulary size (0 = the byte tokenizer's 257)")
  bench.add_argument("--batch", type=int, default=0, help="sequences per replica (0 = the config's)")
  bench.add_argument("--seq_len", type=int, default=0, help="tokens per sequence (0 = the config's)")
  bench.add_argument("--replicas_per_device", type=int, default=1)
  bench.add_argument("--devices", type=int, default=1, help="devices the mapped step spans")
  bench.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
  bench.add_argument("--repeats", type=int, default=3, help="alternating repetitions of both programs")
  args = bench.parse(argv)
  import jax
  import numpy as np
  from experiments.lib import mfu as mfu_lib
  from noloco_jax.inner import step as inner
  from noloco_jax.parallel import mesh as mesh_lib
  from noloco_jax.parallel import sharding as sharding_lib
  from noloco_jax.tools import dryrun
  from noloco_jax.training import build as build_lib

  cfg = bench.config()
  cfg.num_devices = args.devices
  cfg.num_replicas = args.devices * args.replicas_per_device
  cfg.outer.kind = "none"  # the inner step only
  if args.preset:
    cfg.model.preset = args.preset
    for field in ("d_model", "num_layers", "num_heads", "mlp_dim"):
      cfg.model[field] = 0  # the preset's sizes, not a config argument's overrides
  cfg.data.batch_size = args.batch or cfg.data.batch_size
  cfg.data.seq_len = args.seq_len or cfg.data.seq_len
  vocab = args.vocab or 257
  cfg.model.vocab_size = vocab
  bench.override(cfg)

  devices = jax.devices()[:args.devices]
  mesh = mesh_lib.make_mesh(cfg.num_replicas, cfg.num_devices, devices=devices)
  setup = build_lib.build(cfg, mesh=mesh, vocab_size=vocab, check_data=False)
  n, B, L = cfg.num_replicas, cfg.data.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  batches = rng.integers(0, vocab, size=(n, B, L + 1)).astype(np.int32)
  global_batch = sharding_lib.global_array(setup.mesh, batches, n)
  state = setup.init_state()

  optimizer = inner.make_optimizer(cfg.inner, cfg.num_steps)

  def plain_step(s, b):
    loss, grads = inner.compute_grads(s.params, b, setup.model.loss)
    return inner.apply_grads(s, grads, optimizer), loss

  plain_jit = jax.jit(plain_step, donate_argnums=0)
  device = devices[0]
  single = jax.device_put(jax.tree.map(lambda x: np.asarray(x)[0], state), device)
  single_batch = jax.device_put(batches[0], device)

  def peak_in_use():
    stats = device.memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None

  # Compile both (the dry run's memory figure for each), then run plain first: see the docstring.
  predicted = {"plain": dryrun.program_memory(plain_jit.lower(single, single_batch).compile())["peak"],
               "mapped": dryrun.program_memory(setup.inner_step.lower(state, global_batch).compile())["peak"]}
  measured = {}

  def run_plain(s):
    for _ in range(args.steps):
      s, loss = plain_jit(s, single_batch)
    jax.block_until_ready(loss)
    return s

  def run_mapped(s):
    for _ in range(args.steps):
      s, metrics = setup.inner_step(s, global_batch)
    jax.block_until_ready(metrics)
    return s

  single = run_plain(single)  # warm-up
  measured["plain"] = peak_in_use()
  state = run_mapped(state)
  measured["mapped"] = peak_in_use()
  times = {"plain": [], "mapped": []}
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    single = run_plain(single)
    t1 = time.perf_counter()
    state = run_mapped(state)
    t2 = time.perf_counter()
    times["plain"].append((t1 - t0) / args.steps)
    times["mapped"].append((t2 - t1) / args.steps)

  flops_tok = setup.model.flops_per_token(L)
  peak = mfu_lib.peak_flops(device.device_kind, device.platform)

  def side(name, tokens, num_devices):
    step_s = statistics.median(times[name])
    return {"step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "mfu": mfu_lib.mfu(tokens / step_s, flops_tok, peak, num_devices),
            "peak_bytes_in_use": measured[name], "predicted_peak_bytes": predicted[name],
            "step_s_all": times[name]}

  result = {
      "benchmark": "bench_mfu",
      "platform": device.platform,
      "device_kind": device.device_kind,
      "devices": len(devices),
      "replicas": n,
      "replicas_per_device": args.replicas_per_device,
      "model": cfg.model.preset,
      "vocab_size": setup.model.vocab_size,
      "dtype": cfg.model.dtype,
      "attention": cfg.model.attention,
      "loss_chunk": cfg.model.loss_chunk,
      "remat": cfg.model.remat,
      "num_params": setup.model.num_params(),
      "batch_per_replica": B,
      "seq_len": L,
      "flops_per_token": flops_tok,
      "flops_convention": mfu_lib.FLOPS_CONVENTION,
      "peak_flops_per_device": peak,
      **side("mapped", n * B * L, len(devices)),
      "plain": side("plain", B * L, 1),
  }
  # Throughput of the mapped step per device over the plain step's (1.0 = the mapping costs nothing).
  result["throughput_ratio_vs_plain"] = (result["tokens_per_s"] / len(devices)) / result["plain"]["tokens_per_s"]

  def text(r):
    mfu_text = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"mapped {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu_text}; "
            f"plain {r['plain']['step_s'] * 1e3:.1f} ms/step; ratio {r['throughput_ratio_vs_plain']:.3f}")

  return bench.finish(result, text=text)


if __name__ == "__main__":
  harness.run(main)
