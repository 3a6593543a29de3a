"""Starts one multi-process JAX job on this machine: P processes over loopback, each with its own CPU devices.

For tests, demos and benchmarks of the multi-host code paths without a cluster:

    python -m noloco_jax.runtime.launch_local --num_processes=2 --devices_per_process=4 -- \\
        --config=configs/default.py:smoke --workdir=runs/mp2

Everything after `--` goes to every process (by default `python -m noloco_jax.main`). Each process gets
NOLOCO_COORDINATOR_ADDRESS=127.0.0.1:PORT (a free port unless --port), NOLOCO_NUM_PROCESSES=P,
NOLOCO_PROCESS_ID=i, JAX_NUM_CPU_DEVICES=devices_per_process and JAX_PLATFORMS=cpu. Output lines are
prefixed with `[i]`, or written to LOG_DIR/process_i.log with --log_dir.

If one process fails, the launcher gives the others --grace_s seconds to exit on their own (they should:
see distributed.py) and then kills them (with --keep_going it lets them run: the asynchronous
schedule's processes train on without the failed one, docs/async.md); its exit status is that of the
process that failed first (its peers then fail because of it), a process killed by signal N counting as
128 + N (137 for SIGKILL), as a shell reports it: a job whose process 1 was SIGKILLed (the OOM killer)
exits 137, not process 0's 1.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP sent to the launcher are passed on to every process, and the launcher
waits for them to exit before it does (its last line then names the signal): on SIGTERM each saves a
checkpoint and exits 0, so stopping the launcher stops the job as stopping one training process would.
The processes run in their own process group, so a Ctrl-C in the terminal reaches them once, through the
launcher, not twice.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # passed on to the processes (see main)


def free_port() -> int:
  """A TCP port that was free a moment ago (the coordinator binds it right after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, devices_per_process: int, port: int,
                extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ)
  env.update({
      "NOLOCO_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
      "NOLOCO_NUM_PROCESSES": str(num_processes),
      "NOLOCO_PROCESS_ID": str(process_id),
      "JAX_NUM_CPU_DEVICES": str(devices_per_process),
      "JAX_PLATFORMS": "cpu",
      "TF_CPP_MIN_LOG_LEVEL": env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
      "PYTHONUNBUFFERED": "1",
  })
  if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
    del env["XLA_FLAGS"]  # it would override JAX_NUM_CPU_DEVICES
  env.update(extra or {})
  return env


class Job:
  """P running processes of one job (`python -m module ARGS`, or `python script ARGS`); `wait()`
  returns their exit statuses.

  `wrap(i, command)`: the command process i actually runs, e.g. the command prefixed to enter a network
  namespace of its own (experiments/lib/node_links.py); it must exec the command in place (same pid), so
  that signals reach the process.
  """

  def __init__(self, num_processes: int, devices_per_process: int, args: Sequence[str], *,
               module: str = "noloco_jax.main", script: str | None = None, port: int = 0,
               log_dir: str | None = None, env: dict[str, str] | None = None, cwd: str | None = None,
               wrap: Callable[[int, list[str]], list[str]] | None = None):
    self.port = port or free_port()
    self.procs: list[subprocess.Popen] = []
    self.first_failure: int | None = None  # the index of the process seen failing first (`wait`)
    self.log_paths: list[str | None] = []
    self._threads = []
    for i in range(num_processes):
      cmd = [sys.executable, *([script] if script else ["-m", module]), *args]
      cmd = wrap(i, cmd) if wrap else cmd
      log_path = os.path.join(log_dir, f"process_{i}.log") if log_dir else None
      if log_path:
        os.makedirs(log_dir, exist_ok=True)
        out = open(log_path, "w")
      else:
        out = subprocess.PIPE
      # process_group=0: a group of their own, out of the terminal's reach (module docstring).
      proc = subprocess.Popen(cmd, env=process_env(i, num_processes, devices_per_process, self.port, env),
                              stdout=out, stderr=subprocess.STDOUT, cwd=cwd, text=True, process_group=0)
      if log_path:
        out.close()
      else:
        t = threading.Thread(target=_relay, args=(proc.stdout, f"[{i}] "), daemon=True)
        t.start()
        self._threads.append(t)
      self.procs.append(proc)
      self.log_paths.append(log_path)

  def forward(self, signum: int) -> None:
    """Sends `signum` to every process still running (each reacts as it would to the signal itself)."""
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signum)

  def wait(self, timeout_s: float | None = None, grace_s: float = 60.0, keep_going: bool = False) -> list[int]:
    """Waits for all processes; after the first failure (unless `keep_going`), or past `timeout_s`, the
    rest get `grace_s`."""
    deadline = None if timeout_s is None else time.time() + timeout_s
    while any(p.poll() is None for p in self.procs):
      self._note_failure()
      failed = not keep_going and self.first_failure is not None
      if failed or (deadline is not None and time.time() > deadline):
        self._stop_rest(grace_s)
        break
      time.sleep(0.1)
    self._note_failure()  # before the launcher's own signals could be taken for a cause (none sent yet here)
    for t in self._threads:
      t.join(timeout=5)
    return [p.wait() for p in self.procs]

  def _note_failure(self) -> None:
    """Records the process seen failing first. Of several seen at once, one killed by a signal: a peer
    that fails because another died exits with status 1 (distributed.py, peer_watch.py)."""
    if self.first_failure is not None:
      return
    failed = [(p.returncode >= 0, i) for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
    if failed:
      self.first_failure = min(failed)[1]

  def _stop_rest(self, grace_s: float) -> None:
    """Gives the processes still running `grace_s` to end, then SIGTERM and 10 s more, then SIGKILL."""
    for wait_s, stop in ((grace_s, lambda p: p.send_signal(signal.SIGTERM)), (10, lambda p: p.kill())):
      end = time.time() + wait_s
      while time.time() < end and any(p.poll() is None for p in self.procs):
        time.sleep(0.1)
      for p in self.procs:
        if p.poll() is None:
          stop(p)


def exit_status(code: int) -> int:
  """A Popen return code as a shell reports it: 128 + N for a process killed by signal N (Popen says -N)."""
  return 128 - code if code < 0 else code


def describe(codes: Sequence[int], first_failure: int | None = None) -> str:
  """`[1, -9]`, 1 -> "exit statuses [1, 137]: process 1 failed first; process 1 was killed by signal 9 (SIGKILL)"."""
  text = f"exit statuses {[exit_status(c) for c in codes]}"
  words = [f"process {first_failure} failed first"] if first_failure is not None and sum(c != 0 for c in codes) > 1 else []
  words += [f"process {i} was killed by signal {-c} ({_signal_name(-c)})" for i, c in enumerate(codes) if c < 0]
  return text + (": " + "; ".join(words) if words else "")


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return "unknown signal"


def _relay(stream, prefix: str) -> None:
  for line in stream:
    sys.stdout.write(prefix + line)
  sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4, help="fake CPU devices per process")
  parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0 = a free one)")
  parser.add_argument("--module", default="noloco_jax.main", help="python -m MODULE is run by every process")
  parser.add_argument("--log_dir", default=None, help="write process_i.log files here instead of stdout")
  parser.add_argument("--timeout_s", type=float, default=None, help="kill the job after this long")
  parser.add_argument("--grace_s", type=float, default=60.0,
                      help="after a process fails, how long the others may take to exit before being killed")
  parser.add_argument("--keep_going", action="store_true",
                      help="a failed process does not stop the others (outer.schedule=async: they train on)")
  opts = parser.parse_args(own)
  # Installed before the processes start, so no signal can end the launcher and leave them running;
  # one that arrives while they are being started is passed on once they all exist.
  pending: list[int] = []
  received: list[int] = []  # the signals passed on, named in the last line (a Ctrl-C ends the job: say so)
  job: Job | None = None

  def on_signal(signum, frame):
    del frame
    received.append(signum)
    print(f"launch_local: {signal.Signals(signum).name} received; passing it on to the processes and waiting "
          "for them to exit.", flush=True)
    if job is None:
      pending.append(signum)
    else:
      job.forward(signum)

  for sig in FORWARDED:
    signal.signal(sig, on_signal)
  job = Job(opts.num_processes, opts.devices_per_process, rest, module=opts.module, port=opts.port,
            log_dir=opts.log_dir)
  for signum in pending:
    job.forward(signum)
  print(f"launch_local: {opts.num_processes} processes × {opts.devices_per_process} CPU devices, coordinator "
        f"127.0.0.1:{job.port}, pids {[p.pid for p in job.procs]}", flush=True)
  codes = job.wait(opts.timeout_s, opts.grace_s, keep_going=opts.keep_going)
  names = ", ".join(dict.fromkeys(signal.Signals(n).name for n in received))
  why = f"stopped by {names} (passed on to every process); " if received else ""
  print(f"launch_local: {why}{describe(codes, job.first_failure)}", flush=True)
  if job.first_failure is not None:
    return exit_status(codes[job.first_failure])
  return next((exit_status(c) for c in codes if c != 0), 0)  # stopped at --timeout_s


if __name__ == "__main__":
  sys.exit(main())
