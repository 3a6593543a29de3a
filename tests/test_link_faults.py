"""NOLOCO_FAULTS `linkdown`: a process's link really drops for t seconds (runtime/link_faults.py).

* The pieces: the process's own TCP ports read from /proc, and the one-line refusal where the drop
  cannot be made (not root, no tc, or the machine's own network namespace).
* A 2-process NoLoCo job over loopback inside a new network namespace: process 1's link drops for
  3 s after step 4; the job completes, and process 0's round at step 6 waits out the outage.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from noloco_jax.runtime import failures
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import faults
from noloco_jax.runtime import link_faults

import mp_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_own_tcp_ports_lists_this_processs_sockets():
  with socket.socket() as listening, socket.socket() as client:
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    client.connect(listening.getsockname())
    accepted, _ = listening.accept()
    with accepted:
      ports = link_faults.own_tcp_ports()
      mine = listening.getsockname()[1], client.getsockname()[1]
      assert set(mine) <= set(ports)
  assert not set(mine) & set(link_faults.own_tcp_ports())  # closed: no longer this process's


def test_linkdown_where_it_cannot_be_made_is_refused_in_one_line():
  reason = link_faults.unavailable_reason()
  if reason is None:
    pytest.skip("this test process may drop links (root, tc, own network namespace)")
  with pytest.raises(failures.ReportedError) as raised:  # printed as this one line by main.py
    faults.Injector(faults.parse("linkdown:process=0,step=1,seconds=1"), 0)
  message = str(raised.value)
  assert message.startswith("NOLOCO_FAULTS: linkdown ") and "\n" not in message and reason in message
  assert faults.Injector(faults.parse("linkdown:process=1,step=1,seconds=1"), 0).faults == []  # not ours


def _namespace_reason() -> str | None:
  if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
    return "needs root, unshare and tc (iproute2)"
  if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
    return "unshare -n is not permitted here"
  return None


@pytest.mark.skipif(_namespace_reason() is not None, reason=str(_namespace_reason()))
def test_partner_waits_out_a_three_second_link_drop_and_the_job_completes(tmp_path):
  outage_s = 3.0
  workdir, trace = tmp_path / "run", tmp_path / "trace"
  # NoLoCo, 2 processes × 1 device, H = 3 (rounds at steps 3 and 6), one compiled round program
  # (round_robin) so that no compile sits in the round we look at. Process 1's link drops after step
  # 4; it computes steps 5 and 6 and then cannot deliver its half of round 2 until the link is back.
  launch = [sys.executable, "-m", "noloco_jax.runtime.launch_local", "--num_processes=2", "--devices_per_process=1",
            f"--log_dir={tmp_path / 'logs'}", f"--timeout_s={mp_env.JOB_TIMEOUT_S}", "--grace_s=20", "--",
            "--config=configs/default.py:smoke", f"--workdir={workdir}", "--config.num_replicas=2",
            "--config.num_steps=6", "--config.outer.inner_steps=3", "--config.outer.pairing=round_robin",
            "--config.eval_every=0", "--config.log_every=3"]
  env = dict(os.environ, NOLOCO_FAULTS=f"linkdown:process=1,step=4,seconds={outage_s}", NOLOCO_TRACE=str(trace),
             **mp_env.env(), PYTHONPATH=REPO)
  script = "ip link set lo up && exec " + " ".join(f"'{a}'" for a in launch)
  done = subprocess.run(["unshare", "-n", "sh", "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                        timeout=mp_env.JOB_TIMEOUT_S + 60)
  logs = "".join(open(tmp_path / "logs" / f"process_{p}.log").read()[-2000:] for p in (0, 1))
  assert done.returncode == 0, done.stdout[-2000:] + logs
  rows = [json.loads(line) for line in open(trace / "trace_0.jsonl")]
  wait = {r["step"]: r["round_s"] for r in rows}
  # Process 0 reached round 2 (step 6) about when process 1 did, right after the drop began, and
  # could not finish it before process 1's packets flowed again: it waited most of the outage.
  assert wait[6] > 0.7 * outage_s, wait
  assert [r["step"] for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/loss" in r] == [3, 6]
