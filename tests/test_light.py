"""The light install: no TensorFlow on import or at run time, TensorBoard events without it, and
Grain worker processes that change neither the batches nor the resume."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from noloco_jax.io import data
from noloco_jax.io import writers
from test_data import take  # pylint: disable=g-bad-import-order
from test_data import text_config  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Never imported by a run. clu is (its parameter overview, io/metrics.py), but not clu.metric_writers, which
# imports TensorFlow.
HEAVY = ("tensorflow", "matplotlib", "torch", "clu.metric_writers")


def test_main_and_a_run_set_up_import_no_tensorflow(tmp_path):
  # A fresh interpreter: this process has imported whatever other tests needed.
  code = f"""
import json, sys
import noloco_jax.main
heavy = lambda: sorted(h for h in {HEAVY!r} if any(m == h or m.startswith(h + '.') for m in sys.modules))
after_import = heavy()
from configs import default
from noloco_jax.io import data, metrics
from noloco_jax.training import loop
c = default.get_config().data
c.data_dir = {str(tmp_path / 'tfds')!r}
c.mode = "stream"  # Reads the TFDS corpus without tokenising all of it first (seconds saved).
it = data.make_train_iterator(c, seed=0, replica_ids=[0, 1], num_replicas=2, vocab_size=257)
next(it); it.close()
w = metrics.make_writer({str(tmp_path / 'run')!r}); w.write_scalars(1, {{"a": 1.0}}); w.close()
after_run = heavy()
print(json.dumps([after_import, after_run, "clu.parameter_overview" in sys.modules]))
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  after_import, after_run, clu_used = json.loads(out.stdout.strip().splitlines()[-1])
  assert after_import == [], after_import  # `import noloco_jax.main` (the CLI) loads none of them ...
  assert after_run == [], after_run  # ... nor do the TFDS corpus, the Grain iterator and the writers ...
  assert clu_used  # ... although the run set-up imports clu (its parameter overview): clu without TensorFlow.


def test_tensorboard_events_read_back_by_tensorboard(tmp_path):
  # TensorBoard's own reader, which also turns scalar values into the tensors its UI plots.
  from tensorboard.backend.event_processing import event_file_loader  # pylint: disable=g-import-not-at-top
  from tensorboard.util import tensor_util  # pylint: disable=g-import-not-at-top

  w = writers.TensorBoardWriter(str(tmp_path))
  w.write_scalars(3, {"train/loss": np.float32(2.5), "comm/collective_operand_bytes_per_replica": 1024})
  w.write_scalars(7, {"train/loss": 1.25})
  w.close()
  assert "tfevents" in os.path.basename(w.path)
  events = list(event_file_loader.EventFileLoader(w.path).Load())
  assert events[0].file_version == "brain.Event:2"
  got = [(e.step, v.tag, float(tensor_util.make_ndarray(v.tensor))) for e in events[1:] for v in e.summary.value]
  assert {v.metadata.plugin_data.plugin_name for e in events[1:] for v in e.summary.value} == {"scalars"}
  assert got == [(3, "train/loss", 2.5), (3, "comm/collective_operand_bytes_per_replica", 1024.0), (7, "train/loss", 1.25)]


def test_progress_log_reports_rate_and_time_shares(caplog):
  progress = writers.ProgressLog(num_train_steps=10, every_secs=0.0)
  with caplog.at_level(logging.INFO):
    progress(1)  # The first call only starts the clock.
    with progress.timed("eval"):
      pass
    progress(5)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
  assert len(lines) == 1 and "(5/10)" in lines[0] and "% eval" in lines[0], lines


@pytest.mark.parametrize("mode,workers", [("stream", 1), ("array", 2)])
def test_grain_workers_give_the_same_batches_and_resume(tmp_path, mode, workers):
  texts = {f"{i}.txt": f"document {i} " * (5 + 3 * i) for i in range(6)}
  c = text_config(tmp_path, texts, seq_len=7, batch_size=2, mode=mode, shuffle_buffer=3)
  batches, states = {}, {}
  for w in (0, workers):
    c.workers = w
    with data.make_train_iterator(c, seed=3, replica_ids=[1], num_replicas=2, vocab_size=257) as it:
      first = take(it, 3)
      states[w] = json.loads(json.dumps(it.get_state()))
      batches[w] = np.stack(first + take(it, 4))
      it.set_state(states[w])  # Rewinds the worker's pipeline too.
      np.testing.assert_array_equal(np.stack(take(it, 4)), batches[w][3:])
  np.testing.assert_array_equal(batches[workers], batches[0])  # Workers change nothing but speed.
  c.workers = 0
  with data.make_train_iterator(c, seed=3, replica_ids=[1], num_replicas=2, vocab_size=257) as it:
    with pytest.raises(ValueError, match=r"workers.*\(%d, 0\)" % workers):
      it.set_state(states[workers])  # Grain's worker state differs in form: named, not misread.


def test_stream_mode_takes_at_most_one_worker(tmp_path):
  c = text_config(tmp_path, {"a.txt": "text " * 40}, seq_len=7, mode="stream", workers=2)
  with pytest.raises(ValueError, match=r"config.data.workers=2 is not valid: 0 or 1 in stream mode"):
    data.make_train_iterator(c, seed=0, replica_ids=[0], num_replicas=1, vocab_size=257)


def test_the_parameter_table_is_one_replicas_from_clu():
  """clu.parameter_overview (issue 34 item 9): the table a run logs at start, of one replica, from shapes."""
  import jax  # pylint: disable=g-import-not-at-top
  from noloco_jax.io import metrics  # pylint: disable=g-import-not-at-top
  from noloco_jax.models import llama  # pylint: disable=g-import-not-at-top
  model = llama.LlamaModel(llama.LlamaConfig(vocab_size=257, d_model=16, num_layers=2, num_heads=2, mlp_dim=32,
                                             max_seq_len=8))
  one = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), np.int32))
  stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype), one)  # 4 replicas
  table = metrics.parameter_table(stacked)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(one))
  assert f"Total: {count:,} -- {4 * count:,} bytes" in table, table
  assert "| embed/embedding" in table and "(257, 16)" in table and "(4, 257, 16)" not in table, table


def test_a_clu_average_would_move_the_logged_training_means():
  """Why the inner metrics are not a clu.metrics collection (docs/running.md, "clu"): clu's Average adds
  each step's sum into a float32 total, while the logged train/loss is NumPy's mean of the interval's
  stacked [steps, replicas] losses (pairwise summation). Over the smoke config's intervals (3 steps × 8
  replicas) the two differ in the last bit for a good share of random draws: the golden run would move."""
  import flax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from clu import metrics as clu_metrics  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class TrainMetrics(clu_metrics.Collection):
    loss: clu_metrics.Average.from_output("loss")

  rng, differ = np.random.default_rng(0), 0
  for _ in range(200):
    losses = (5 + 0.3 * rng.normal(size=(3, 8))).astype(np.float32)
    collected = TrainMetrics.empty()
    for step_losses in losses:
      collected = collected.merge(TrainMetrics.single_from_model_output(loss=jnp.asarray(step_losses)))
    differ += float(collected.compute()["loss"]) != float(np.stack(list(losses)).mean())
  assert differ > 20, differ  # measured: 608 of 2,000 draws
