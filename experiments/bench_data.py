r"""How fast the data pipeline produces batches, against what a training step consumes.

    python experiments/bench_data.py --json                      # default config: 8 replicas, stdlib
    python experiments/bench_data.py --json --config.data.mode=stream
    python experiments/bench_data.py --json --metrics=runs/default/metrics.jsonl   # vs. a real run

Reports, for all `config.num_replicas` replicas in one process (the most any process produces):
  setup_s            time to the first batch (corpus build and tokenization on a cold cache, `--cold`);
  produced_*         steps/s and tokens/s of this one process with Grain's prefetch thread (and its
                     worker processes with --config.data.workers=N), consumed by a loop that does
                     nothing else (what the trainer sees when its step is instantaneous);
  produced_sync_*    the same with prefetch = 0 and no workers, i.e. the cost paid in the caller's thread;
  consumed_*         the training loop's steps/s, from --consumed_steps_per_s or the last
                     `perf/steps_per_s` in a run's metrics.jsonl (--metrics); absent when neither is given;
  headroom           produced / consumed steps per second (> 1: the pipeline is not the bottleneck).
Tokens count all L+1 tokens of each sequence.
"""

import json
import tempfile
import time

from experiments.lib import harness
from noloco_jax.io import data


def _consumed_steps_per_s(args) -> float | None:
  if args.consumed_steps_per_s > 0:
    return args.consumed_steps_per_s
  if args.metrics:
    value = None
    with open(args.metrics) as f:
      for line in f:
        value = json.loads(line).get("perf/steps_per_s", value)
    return value
  return None


def _time(config, steps: int) -> tuple[float, float]:
  """(seconds to the first batch, steps per second over `steps` more)."""
  t0 = time.perf_counter()
  vocab_size = data.make_tokenizer(config.data).vocab_size
  it = data.make_train_iterator(config.data, seed=config.seed, replica_ids=range(config.num_replicas),
                                num_replicas=config.num_replicas, vocab_size=vocab_size)
  next(it)
  setup = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(steps):
    next(it)
  rate = steps / (time.perf_counter() - t0)
  it.close()
  return setup, rate


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, config=True)
  bench.add_argument("--steps", type=int, default=2000, help="batches to time (after one warm-up batch)")
  bench.add_argument("--cold", action="store_true", help="use an empty temporary data dir: time the corpus build too")
  bench.add_argument("--consumed_steps_per_s", type=float, default=0.0, help="training steps/s to compare with")
  bench.add_argument("--metrics", default="", help="a run's metrics.jsonl: read its last perf/steps_per_s")
  args = bench.parse(argv)
  config = bench.override(bench.config())
  tmp = None
  if args.cold:
    tmp = tempfile.TemporaryDirectory()
    config.data.data_dir = tmp.name
  per_step = config.num_replicas * config.data.batch_size * (config.data.seq_len + 1)
  setup, rate = _time(config, args.steps)
  workers = config.data.get("workers", 0)
  config.data.prefetch = 0
  if workers:
    config.data.workers = 0
  _, sync_rate = _time(config, args.steps)
  result = {
      "source": config.data.source, "mode": config.data.mode or "(source default)",
      "tokenizer": config.data.tokenizer, "num_replicas": config.num_replicas, "workers": workers,
      "batch_size": config.data.batch_size, "seq_len": config.data.seq_len,
      "tokens_per_step": per_step, "cold_cache": args.cold, "setup_s": round(setup, 3),
      "produced_steps_per_s": round(rate, 1), "produced_tokens_per_s": round(rate * per_step),
      "produced_sync_steps_per_s": round(sync_rate, 1),
      "produced_sync_tokens_per_s": round(sync_rate * per_step),
  }
  consumed = _consumed_steps_per_s(args)
  if consumed:
    result.update(consumed_steps_per_s=round(consumed, 3), consumed_tokens_per_s=round(consumed * per_step),
                  headroom=round(rate / consumed, 1))
  if tmp:
    tmp.cleanup()
  return bench.finish(result, text=lambda r: "\n".join(f"{k:28s} {v}" for k, v in r.items()))


if __name__ == "__main__":  # Also keeps Grain's spawned workers from re-running main.
  harness.run(main)
