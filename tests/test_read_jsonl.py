"""noloco_jax/io/metrics.read_jsonl: the one reader of the JSONL logs, strict by default; the merge of
an asynchronous job's logs and the benchmarks' live traces use its tolerant options."""

import json

import pytest

from noloco_jax.io import metrics as metrics_lib


def test_strict_by_default_and_tolerant_when_asked(tmp_path):
  path = tmp_path / "log.jsonl"
  # A row, a blank line, a line cut by a crash, a row appended after the restart, a line being written.
  path.write_text(json.dumps({"step": 1}) + "\n\n" + '{"step": 2, "lo' + "\n" + json.dumps({"step": 3}) + "\n" + '{"ste')
  with pytest.raises(json.JSONDecodeError):
    metrics_lib.read_jsonl(str(path))
  assert metrics_lib.read_jsonl(str(path), skip_damaged=True) == [{"step": 1}, {"step": 3}]  # rows after it stand
  with pytest.raises(FileNotFoundError):
    metrics_lib.read_jsonl(str(tmp_path / "absent.jsonl"))
  assert metrics_lib.read_jsonl(str(tmp_path / "absent.jsonl"), missing_ok=True) == []
