"""The dry run: compile from shapes on a described topology, report memory and bytes, fail if too big."""

import dataclasses
import os
import subprocess
import sys

import pytest

from configs import paper
from noloco_jax.tools import dryrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A paper row shrunk to seconds (smoke), with the row's PP devices on fsdp: 4 replicas × fsdp 2 = 8 devices.
SMOKE = "model=small,gpus=8,dp=4,pp=2,method=noloco,data=c4,pp_as=fsdp,smoke"


def test_parse_topology():
  assert dryrun.parse_topology("64x80GB") == dryrun.Topology(64, 80 * 10 ** 9, "64x80GB")
  assert dryrun.parse_topology("8x16GiB").bytes_per_device == 16 * 2 ** 30
  assert dryrun.parse_topology("16x100KB").bytes_per_device == 100_000
  for bad in ("80GB", "64x80", "0x80GB", "64x80XB"):
    with pytest.raises(ValueError, match="DEVICESxMEMORY"):
      dryrun.parse_topology(bad)


def test_dry_run_compiles_a_grid_config_on_fake_devices_and_counts_bytes():
  cfg = paper.get_config(SMOKE)
  topology = dryrun.parse_topology("8x80GB")
  result = dryrun.analyse(cfg, topology)
  assert result["mesh"] == {"replica": 4, "fsdp": 2} and result["devices_used"] == 8
  assert result["num_params"] == result["num_params_counted"]
  assert set(result["programs"]) == {"inner_step", "outer_round", "eval_step"}
  for program in result["programs"].values():
    assert program["arguments"] > 0 and program["peak"] >= program["arguments"]
  # The bytes the compiled round really sends, summed over a replica's two devices, are the formula's.
  assert result["bytes_per_round_counted"] == result["bytes_per_round_formula"] > 0
  # On the wire, between replicas (outer/wire.py): a pair exchange sends and receives its one message,
  # here split over each replica's two fsdp devices; the compiled round's collectives say the same.
  for key in ("sent", "received", "operand"):
    assert result["wire_per_round_counted"][key] == result["wire_per_round_formula"][key] == result["bytes_per_round_formula"]
  # Half the state per device: every leaf of this model is split over fsdp except the counters.
  assert result["state_bytes_per_device"] < 0.51 * result["state_bytes_per_replica"]
  assert result["fits"]
  text = dryrun.report(cfg, topology, result)
  assert "FITS" in text and "outer_round" in text and "sends" in text and "on the wire" in text

  tiny = dataclasses.replace(topology, bytes_per_device=1000, text="8x1KB")
  with pytest.raises(dryrun.DoesNotFit, match="8x1KB"):
    dryrun.check(dict(result, fits=False, capacity_bytes=1000), tiny)


def test_command_line_fails_clearly_when_it_does_not_fit():
  # 16 fake devices (more than this session's 8): a subprocess, where --dry_run creates them.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  cmd = [sys.executable, "-m", "noloco_jax.main", "--dry_run", "--topology=16x100KB",
         "--config=configs/paper.py:" + SMOKE.replace("gpus=8,dp=4", "gpus=16,dp=8")]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "mesh replica 8 × fsdp 2 = 16 devices used" in proc.stdout
  # The state alone is over 100 KB per device: it says so without compiling anything.
  assert "DOES NOT FIT (the training state alone)" in proc.stdout
  assert "noloco_jax dry run: " in proc.stderr and "16x100KB" in proc.stderr
