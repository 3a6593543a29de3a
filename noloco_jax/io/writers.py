"""Metric writers without TensorFlow: TensorBoard event files, metrics.jsonl, log lines, progress, and
optionally Weights & Biases.

`MetricWriter` has the methods of clu's `metric_writers.MetricWriter` that this project calls
(write_scalars, flush, close) and its own write_summary; the run's config goes to W&B when it starts.
We do not subclass clu's class: importing any of `clu.metric_writers` imports TensorFlow.

TensorBoard reads event files: TFRecord-framed `Event` protocol buffers in a file whose name holds
"tfevents". The `tensorboard` package ships both the protobuf classes and the record framing (the
masked CRC-32C of TFRecord), neither of which needs TensorFlow; `TensorBoardWriter` uses just those,
never `tensorboard.compat.tf`, which would import TensorFlow wherever it happens to be installed.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging
import numpy as np


class MetricWriter(abc.ABC):
  """The writer interface: scalars by step and the end-of-run summary."""

  @abc.abstractmethod
  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    """One value per name at `step`."""

  def write_summary(self, summary: Mapping[str, Any]):
    """The end-of-run summary (training/summary.py's scalars); not one of clu's methods."""
    del summary

  def flush(self):
    pass

  def close(self):
    pass


def _float(value) -> float:
  return float(np.asarray(value))


class TensorBoardWriter(MetricWriter):
  """Scalars as TensorBoard events in `logdir/events.out.tfevents.<time>.<host>`."""

  def __init__(self, logdir: str):
    # Imported here: the protobuf modules cost ~0.1 s, paid only by the process that writes.
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    from tensorboard.summary.writer import record_writer  # pylint: disable=g-import-not-at-top

    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    os.makedirs(logdir, exist_ok=True)
    # Time and host in the name, as TensorBoard's own writers do: a resumed run opens a second file
    # beside the first, and TensorBoard reads the directory's files in name order.
    self.path = os.path.join(logdir, f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}")
    self._records = record_writer.RecordWriter(open(self.path, "wb"))
    self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    values = [self._summary_pb2.Summary.Value(tag=k, simple_value=_float(v)) for k, v in scalars.items()]
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=self._summary_pb2.Summary(value=values)))

  def flush(self):
    self._records.flush()

  def close(self):
    if not self._records.closed:
      self._records.close()


class JsonlWriter(MetricWriter):
  """Appends one JSON object per write to `path`: {"step": s, name: value, ...}."""

  def __init__(self, path: str):
    self._file = open(path, "a", buffering=1)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {"step": int(step)}
    for key, value in scalars.items():
      value = _float(value)
      row[key] = value if math.isfinite(value) else str(value)  # JSON has no NaN or inf.
    self._file.write(json.dumps(row) + "\n")

  def flush(self):
    # Durable, not only handed to the OS: the loop flushes before every checkpoint (io/checkpoint/logs.py).
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self):
    self._file.close()


def wandb_mode(mode: str, environ: Mapping[str, str] | None = None) -> str:
  """config.wandb.mode to W&B's: "auto" is online with WANDB_API_KEY in the environment, else offline."""
  if mode != "auto":
    return mode
  return "online" if (environ if environ is not None else os.environ).get("WANDB_API_KEY") else "offline"


class WandbWriter(MetricWriter):
  """One Weights & Biases run: the config at the start, every scalar row at its step, the summary at the end.

  `wandb` is imported here, by the process that writes (process 0), and only when config.wandb.project
  is set: it is an optional extra (`pip install '.[wandb]'`) and starts a service process of its own.
  Its files go to `workdir/wandb/`. A resumed run (the same workdir) continues the same W&B run: its id is
  kept in `workdir/wandb/run_id`. W&B accepts only increasing steps, so rows a resumed run logs again
  (those after the restored checkpoint) are dropped by W&B with a warning; metrics.jsonl stays the
  record that is rewritten exactly (io/checkpoint/logs.py).
  """

  def __init__(self, workdir: str, wandb_config, run_config: Mapping[str, Any] | None = None):
    import wandb  # pylint: disable=g-import-not-at-top  (optional extra; see the docstring)

    self._wandb = wandb
    directory = os.path.join(os.path.abspath(workdir), "wandb")
    os.makedirs(directory, exist_ok=True)
    id_file = os.path.join(directory, "run_id")
    if os.path.isfile(id_file):
      with open(id_file) as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(4)  # W&B run ids: lowercase letters and digits
      with open(id_file, "w") as f:
        f.write(run_id + "\n")
    self.mode = wandb_mode(wandb_config.mode)
    tags = [t.strip() for t in wandb_config.tags.split(",") if t.strip()]
    self.run = wandb.init(
        project=wandb_config.project, entity=wandb_config.entity or None,
        name=wandb_config.name or os.path.basename(os.path.abspath(workdir)), group=wandb_config.group or None,
        tags=tags or None, mode=self.mode, dir=os.path.abspath(workdir), id=run_id, resume="allow",
        config=dict(run_config or {}),
        # Our own log lines stay ours: W&B does not wrap stdout/stderr (its "console" capture).
        settings=wandb.Settings(console="off"))
    self._closed = False

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    self.run.log({k: _float(v) for k, v in scalars.items()}, step=int(step))

  def write_summary(self, summary: Mapping[str, Any]):
    for key, value in summary.items():
      if isinstance(value, (int, float, str, bool)) or np.isscalar(value):
        self.run.summary[key] = value

  def close(self):
    if not self._closed:
      self._closed = True
      self.run.finish()


class LoggingWriter(MetricWriter):
  """One log line per write: `[step] name = value, ...`."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    logging.info("[%d] %s", step, ", ".join(f"{k} = {_float(v):.6g}" for k, v in sorted(scalars.items())))


class MultiWriter(MetricWriter):
  """Every call goes to each writer in turn."""

  def __init__(self, writers: Sequence[MetricWriter]):
    self._writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    for w in self._writers:
      w.write_scalars(step, scalars)

  def write_summary(self, summary: Mapping[str, Any]):
    for w in self._writers:
      w.write_summary(summary)

  def flush(self):
    for w in self._writers:
      w.flush()

  def close(self):
    for w in self._writers:
      w.close()


class ProgressLog:
  """Logs steps/s, percentage done and ETA every `every_secs`; `timed(name)` adds a time share.

  Call it once per step. `timed` measures host wall time of its block: the loop around it fetches
  results, so device work inside the block is finished when it ends.
  """

  def __init__(self, num_train_steps: int, every_secs: float = 30.0, parts: dict[str, float] | None = None):
    """`parts`: {name: seconds} kept by the caller (or by `timed`), shown as shares of the time."""
    self._num_steps, self._every = num_train_steps, every_secs
    self._t0 = self._last_t = time.monotonic()
    self._last_step = None
    self._parts: dict[str, float] = parts if parts is not None else {}

  def __call__(self, step: int) -> None:
    now = time.monotonic()
    if self._last_step is None:
      self._last_step, self._last_t = step, now
      return
    if now - self._last_t < self._every:
      return
    rate = (step - self._last_step) / max(now - self._last_t, 1e-9)
    message = f"{rate:.2f} steps/s, {100 * step / max(self._num_steps, 1):.1f}% ({step}/{self._num_steps})"
    if rate > 0:
      message += f", ETA {(self._num_steps - step) / rate:.0f} s"
    total = now - self._t0
    if self._parts:
      message += " (" + ", ".join(f"{100 * t / total:.1f}% {k}" for k, t in sorted(self._parts.items())) + ")"
    logging.info("progress: %s", message)
    self._last_step, self._last_t = step, now

  @contextlib.contextmanager
  def timed(self, name: str):
    start = time.monotonic()
    try:
      yield
    finally:
      self._parts[name] = self._parts.get(name, 0.0) + time.monotonic() - start
