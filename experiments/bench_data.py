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
import os
import tempfile
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from noloco_jax.io import data  # pylint: disable=g-import-not-at-top,wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Training config.")
_STEPS = flags.DEFINE_integer("steps", 2000, "Batches to time (after one warm-up batch).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
_COLD = flags.DEFINE_bool("cold", False, "Use an empty temporary data dir: time the corpus build too.")
_CONSUMED = flags.DEFINE_float("consumed_steps_per_s", 0.0, "Training steps/s to compare with.")
_METRICS = flags.DEFINE_string("metrics", "", "A run's metrics.jsonl: read its last perf/steps_per_s.")


def _consumed_steps_per_s() -> float | None:
  if _CONSUMED.value > 0:
    return _CONSUMED.value
  if _METRICS.value:
    value = None
    with open(_METRICS.value) as f:
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


def main(argv):
  del argv
  config = _CONFIG.value
  tmp = None
  if _COLD.value:
    tmp = tempfile.TemporaryDirectory()
    config.data.data_dir = tmp.name
  per_step = config.num_replicas * config.data.batch_size * (config.data.seq_len + 1)
  setup, rate = _time(config, _STEPS.value)
  workers = config.data.get("workers", 0)
  config.data.prefetch = 0
  if workers:
    config.data.workers = 0
  _, sync_rate = _time(config, _STEPS.value)
  result = {
      "source": config.data.source, "mode": config.data.mode or "(source default)",
      "tokenizer": config.data.tokenizer, "num_replicas": config.num_replicas, "workers": workers,
      "batch_size": config.data.batch_size, "seq_len": config.data.seq_len,
      "tokens_per_step": per_step, "cold_cache": _COLD.value, "setup_s": round(setup, 3),
      "produced_steps_per_s": round(rate, 1), "produced_tokens_per_s": round(rate * per_step),
      "produced_sync_steps_per_s": round(sync_rate, 1),
      "produced_sync_tokens_per_s": round(sync_rate * per_step),
  }
  consumed = _consumed_steps_per_s()
  if consumed:
    result.update(consumed_steps_per_s=round(consumed, 3), consumed_tokens_per_s=round(consumed * per_step),
                  headroom=round(rate / consumed, 1))
  if tmp:
    tmp.cleanup()
  if _JSON.value:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k:28s} {v}")


if __name__ == "__main__":  # Also keeps Grain's spawned workers from re-running main.
  app.run(main)
