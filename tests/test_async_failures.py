"""How the processes of an asynchronous job fail (issue 33): each ends in one line of ours that says what
happened and what to do, the process hosting the coordination service never takes the others down with
it, and what was saved stays saved.

Through the command line (python -m noloco_jax.main, each process started like launch_local starts it) on
the smoke model; the config check also on the in-memory store.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from configs import default
from noloco_jax import config as config_lib
from noloco_jax.asynchronous import control
from noloco_jax.asynchronous import job as job_lib
from noloco_jax.runtime import launch_local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = ["--config=configs/default.py:smoke", "--config.outer.schedule=async"]


def _start(slot: int, num: int, port: int, workdir: str, log: str, *flags, env=None) -> subprocess.Popen:
  """Process `slot` of a job of `num` processes, as launch_local starts it, its output in `log`."""
  with open(log, "w") as out:
    return subprocess.Popen([sys.executable, "-m", "noloco_jax.main", *ASYNC, f"--workdir={workdir}",
                             f"--config.num_replicas={num}", *flags],
                            env=launch_local.process_env(slot, num, 1, port, env), cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT)


def _lines(log: str) -> list[str]:
  with open(log) as f:
    return f.read().strip().splitlines()


# ---- 3b: processes started with different configs ----


def test_processes_started_with_different_configs_each_refuse_in_one_line(tmp_path):
  """Before: each printed a 23-line traceback (its message right), and process 0, which hosts the
  service, then died by SIGABRT. Now every process names the fields and the processes, exit 2."""
  port, workdir = launch_local.free_port(), str(tmp_path / "run")
  logs = [str(tmp_path / f"process_{i}.log") for i in range(3)]
  procs = [_start(i, 3, port, workdir, logs[i], *(["--config.seed=5"] if i == 1 else [])) for i in range(3)]
  codes = [p.wait(timeout=300) for p in procs]
  text = "\n\n".join("\n".join(_lines(l)[-20:]) for l in logs)
  assert codes == [2, 2, 2], text
  others = {0: "process 1", 1: "processes [0, 2]", 2: "process 1"}
  for i, log in enumerate(logs):
    lines = _lines(log)
    assert not [l for l in lines if "Traceback" in l or "Fatal Python error" in l or "Check failure" in l], text
    assert lines[-1] == (f"noloco_jax: process {i} of this asynchronous job runs another config than {others[i]}: "
                         "seed: processes [0, 2] have 0; processes [1] have 5. Start every process with the same "
                         "config and overrides."), lines[-1]


def _config(**fields):
  cfg = default.get_config("smoke")
  cfg.outer.schedule, cfg.num_replicas = "async", 3
  for key, value in fields.items():
    setattr(cfg, key, value)
  return config_lib.load(cfg)


def test_the_config_check_waits_for_every_slot_and_skips_reserved_ones():
  kv = control.MemoryKV()
  same, other = _config(), _config(seed=5)
  kv.set("live/2", "7:left")  # control.reserve_slot's slot: it trains nothing and posts no config
  later = threading.Timer(0.3, lambda: kv.set(f"{job_lib.CONFIG_KEY}1", json.dumps(
      job_lib.job_checks.flatten_config(other), sort_keys=True)))
  later.start()
  start = time.monotonic()
  with pytest.raises(job_lib.ConfigMismatch, match=r"^process 0 .* than process 1: seed: processes \[0\] have 0; "
                     r"processes \[1\] have 5\."):
    job_lib._check_same_config(kv, 0, 3, same, wait_s=30)  # pylint: disable=protected-access
  assert 0.25 < time.monotonic() - start < 10  # it waited for slot 1, not for the reserved slot 2
  agree = control.MemoryKV()
  agree.set("live/2", "7:left")
  agree.set(f"{job_lib.CONFIG_KEY}1", json.dumps(job_lib.job_checks.flatten_config(same), sort_keys=True))
  job_lib._check_same_config(agree, 0, 3, same, wait_s=30)  # pylint: disable=protected-access
  # A slot that never posts: after wait_s, what was posted is compared.
  lone = control.MemoryKV()
  start = time.monotonic()
  job_lib._check_same_config(lone, 0, 2, same, wait_s=0.3)  # pylint: disable=protected-access
  assert time.monotonic() - start < 5
