"""End to end through train_and_evaluate on 8 fake CPU devices, for every outer kind."""

import json
import os

import numpy as np
import pytest

from configs import default
from noloco_jax.io import metrics as metrics_lib
from noloco_jax import training


@pytest.mark.parametrize("kind", ["noloco", "diloco", "gossip", "ddp", "none"])
def test_each_kind_trains_and_validation_loss_falls(kind, tmp_path):
  cfg = default.get_config("smoke")
  cfg.outer.kind = kind
  result = training.train_and_evaluate(cfg, str(tmp_path))
  assert result["eval/loss"] < result["eval/loss_first"] - 0.2, result["text"]

  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  evals = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in evals] == [0, 6, 12]
  assert np.isclose(evals[-1]["eval/ppl"], np.exp(evals[-1]["eval/loss"]), rtol=1e-6)
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [3, 6, 9, 12]
  assert any(r.get("model/num_params") == result["model/num_params"] for r in rows)
  with open(os.path.join(tmp_path, "config.json")) as f:
    assert json.load(f)["outer"]["kind"] == kind

  comm = train_rows[-1]["comm/collective_operand_bytes_per_replica"]
  params_bytes = result["model/num_params"] * 4
  rounds = cfg.num_steps // cfg.outer.inner_steps
  expected = {"noloco": rounds * params_bytes, "gossip": rounds * params_bytes, "diloco": rounds * params_bytes,
              "ddp": cfg.num_steps * params_bytes, "none": 0}[kind]
  assert comm == expected
  # On the wire: a pair exchange sends and receives its one copy; a ring all-reduce over 8 replicas
  # sends and receives 2·7/8 copies per replica (outer/wire.py).
  ring = 2 * 7 / 8
  wire = {"noloco": rounds * params_bytes, "gossip": rounds * params_bytes, "diloco": rounds * ring * params_bytes,
          "ddp": cfg.num_steps * ring * params_bytes, "none": 0}[kind]
  for key in ("comm/bytes_sent_per_replica", "comm/bytes_received_per_replica"):
    assert train_rows[-1][key] == pytest.approx(wire, rel=1e-12), key
    assert result[key] == train_rows[-1][key]
  if kind in ("noloco", "gossip"):
    with open(os.path.join(tmp_path, "pairings.jsonl")) as f:
      pairings = [json.loads(line) for line in f]
    assert [p["round"] for p in pairings] == list(range(rounds))
    assert all(sorted(sum(p["groups"], [])) == list(range(8)) for p in pairings)
  if kind in ("ddp", "diloco"):  # a global average keeps the replicas together
    assert evals[-1]["replicas/weight_std"] < 1e-6
  if kind in ("noloco", "none"):
    assert evals[-1]["replicas/weight_std"] > 0


def test_simulator_and_mesh_runs_give_the_same_metrics(tmp_path):
  results = {}
  for num_devices in (8, 1):
    cfg = default.get_config("smoke")
    cfg.num_devices = num_devices
    results[num_devices] = training.train_and_evaluate(cfg, str(tmp_path / str(num_devices)))
  a, b = (metrics_lib.read_jsonl(str(tmp_path / str(d) / "metrics.jsonl")) for d in (8, 1))
  for ra, rb in zip(a, b):
    for key in ("train/loss", "eval/loss", "replicas/weight_std"):
      if key in ra:
        np.testing.assert_allclose(ra[key], rb[key], rtol=2e-5, atol=1e-7, err_msg=f"{key} at step {ra['step']}")


def test_the_config_is_parsed_once_per_run(tmp_path, monkeypatch):
  """Issue 22: the ConfigDict is parsed and validated once (main.py: config.load); everything after
  receives the typed config or its sections, which are never parsed again."""
  from noloco_jax import config as config_lib  # pylint: disable=g-import-not-at-top

  parses = []
  real = config_lib.Config.parse.__func__

  def counting(cls, node):
    if not isinstance(node, config_lib.Section):
      parses.append(cls.__name__)
    return real(cls, node)

  for section in {config_lib.Config, *(type(getattr(config_lib.Config(), f)) for f in ("outer", "data", "model",
                                                                                      "inner", "checkpoint"))}:
    monkeypatch.setattr(section, "parse", classmethod(counting))
  config = default.get_config("smoke")
  config.num_steps = 3
  typed = config_lib.load(config)  # what main.py does with the flags' ConfigDict
  assert parses.count("Config") == 1
  parses.clear()
  training.train_and_evaluate(typed, str(tmp_path))
  assert parses == [], parses  # nothing downstream parses a ConfigDict again
