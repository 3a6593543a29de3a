"""The Weights & Biases writer (io/writers.py: WandbWriter, config.wandb), in offline mode, read back from
the run file W&B wrote. Skipped without wandb (pip install '.[wandb]')."""

import glob
import json
import os
import struct

import numpy as np
import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.config.fields import ConfigError
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.io import writers

HINT = "needs wandb: pip install '.[wandb]'"
BLOCK = 32 * 1024  # W&B's run file: LevelDB-log records in 32 KiB blocks after a 7-byte header


def read_wandb_records(path: str):
  """The protobuf Records of a W&B run file (`run-<id>.wandb`): header ':W&B', magic 0xBEE1, version;
  then records of (crc32 4 bytes, length 2 bytes, type 1 byte: 1 full, 2 first, 3 middle, 4 last), which
  never straddle a 32 KiB block boundary (a tail shorter than a record header is zero padding)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
  pos, pending, records = 7, b"", []
  while pos + 7 <= len(data):
    left = BLOCK - pos % BLOCK
    if left < 7:  # padding at the end of a block
      pos += left
      continue
    length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
    if length == 0 and kind == 0:
      pos += left  # zero-filled rest of a block
      continue
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
  return records


def _read_back(workdir):
  files = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(files) == 1, files
  history, summary, config = [], {}, {}
  for rec in read_wandb_records(files[0]):
    kind = rec.WhichOneof("record_type")
    if kind == "history":
      history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    elif kind == "summary":
      summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.summary.update})
    elif kind == "run":
      config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
      project, name, run_id = rec.run.project, rec.run.display_name, rec.run.run_id
    elif kind == "config":
      config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
  return history, summary, config, (project, name, run_id)


def test_auto_mode_is_offline_without_an_api_key():
  assert writers.wandb_mode("auto", {}) == "offline"
  assert writers.wandb_mode("auto", {"WANDB_API_KEY": "x"}) == "online"
  assert writers.wandb_mode("offline", {"WANDB_API_KEY": "x"}) == "offline"


def test_a_bad_mode_is_one_line():
  cfg = default.get_config("smoke")
  cfg.wandb.mode = "cloud"
  with pytest.raises(ConfigError, match=r"^config\.wandb\.mode='cloud' is not valid: one of auto \| online \| offline \| disabled\.$"):
    config_lib.validate(cfg)


def test_a_smoke_run_logs_its_config_every_scalar_and_the_summary_offline(tmp_path, monkeypatch):
  pytest.importorskip("wandb", reason=HINT)
  from noloco_jax import training  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.delenv("WANDB_MODE", raising=False)
  cfg = default.get_config("smoke")
  cfg.wandb.project = "noloco-test"
  cfg.wandb.tags = "smoke,test"
  result = training.train_and_evaluate(cfg, str(tmp_path))
  history, summary, config, (project, name, run_id) = _read_back(str(tmp_path))
  assert (project, name) == ("noloco-test", os.path.basename(str(tmp_path)))
  with open(tmp_path / "wandb" / "run_id") as f:
    assert f.read().strip() == run_id
  # The config: every section, as resolved.
  assert config["outer"]["kind"] == "noloco" and config["num_steps"] == 12
  assert config["wandb"]["project"] == "noloco-test"
  # Every scalar of metrics.jsonl, at its step, with its value.
  rows = metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
  logged = {}
  for h in history:
    step = h["_step"]
    logged.setdefault(step, {}).update({k: v for k, v in h.items() if not k.startswith("_")})
  for row in rows:
    for key, value in row.items():
      if key != "step":
        assert np.isclose(logged[row["step"]][key], value, rtol=1e-6), (row["step"], key)
  assert sorted(logged) == sorted({r["step"] for r in rows})
  # The summary: the scalars of summary.json.
  assert np.isclose(summary["eval/loss"], result["eval/loss"], rtol=1e-6)
  assert summary["model/num_params"] == result["model/num_params"]
  assert np.isclose(summary["comm/bytes_sent_per_replica"], result["comm/bytes_sent_per_replica"])


def test_the_writer_is_made_only_when_a_project_is_set(tmp_path):
  pytest.importorskip("wandb", reason=HINT)
  cfg = config_lib.validate(default.get_config("smoke"))
  writer = metrics_lib.make_writer(str(tmp_path), cfg.wandb, cfg.to_dict())
  assert not any(isinstance(w, writers.WandbWriter) for w in writer._writers)  # pylint: disable=protected-access
  writer.close()
  assert not os.path.exists(tmp_path / "wandb")


def test_changing_the_tracker_never_blocks_or_warns_a_resume():
  from noloco_jax.io.checkpoint import records  # pylint: disable=g-import-not-at-top
  saved = {"seed": 0, "outer": {"kind": "noloco"}}  # a checkpoint from before config.wandb existed
  now = {"seed": 0, "outer": {"kind": "noloco"}, "wandb": {"project": "p", "mode": "auto"}}
  assert records.config_changes(saved, now) == []
  assert records.config_changes({**now, "wandb": {"project": "q"}}, now) == []
