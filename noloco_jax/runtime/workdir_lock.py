"""One run per workdir: an exclusive lock file, `WORKDIR/run.lock`, naming the run that holds it.

Two runs writing one workdir interleave their metrics rows and checkpoints and crash each other
inside orbax; the second run must refuse at once, saying which run holds the workdir. The lock is
taken before anything in the workdir is written and removed when the run ends (normally, by an
exception, or by SIGTERM's preemption save).

How a lock is judged (only process 0 of a job takes it):

- The file is created with O_EXCL and holds JSON: host, pid, the process's start time (from /proc,
  so that a recycled pid is not mistaken for the holder), the time taken and the command line.
- A lock left by a run that died without removing it (kill -9, a crash of the machine) is stale
  when it names this host and its pid is no longer running (or now belongs to another process):
  it is taken over with a warning naming the dead run.
- A lock naming another host cannot be judged from here (its pid means nothing on this machine):
  the run refuses and says which file to delete if that run is known to be dead. Except under SLURM,
  where a resubmitted job usually lands on other nodes (scripts/slurm_gpu.sbatch resumes in the same
  workdir): a lock taken by a SLURM job is stale when it names an earlier run of this same job (a
  requeue: another SLURM_RESTART_COUNT) or a job that `squeue` no longer lists as running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from noloco_jax.runtime import failures

LOCK_NAME = "run.lock"
# An unreadable lock file younger than this is being written by a run starting now (it creates the file,
# then fills it); an older one was left by a run that died in between, and is taken over.
UNREADABLE_GRACE_S = 10.0


class WorkdirLockedError(failures.ReportedError, RuntimeError):
  """Another live run holds the workdir."""


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  start: str | None  # the process's start time in clock ticks after boot (Linux), None elsewhere
  since: str = ""
  command: str = ""
  slurm_job: str | None = None  # SLURM_JOB_ID of the run, when it ran under SLURM
  slurm_restart: str | None = None  # its SLURM_RESTART_COUNT (a requeued job keeps its id)

  def describe(self) -> str:
    return (f"host {self.host}, pid {self.pid}" + (f", SLURM job {self.slurm_job}" if self.slurm_job else "")
            + (f", since {self.since}" if self.since else ""))


def _start_time(pid: int) -> str | None:
  """Field 22 of /proc/PID/stat (start time after boot): tells a recycled pid from the original."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except OSError:
    return None
  return stat.rpartition(")")[2].split()[19]  # fields after the command name, which may hold spaces


def this_process() -> Holder:
  pid = os.getpid()
  return Holder(host=socket.gethostname(), pid=pid, start=_start_time(pid),
                since=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                command=" ".join(sys.argv)[:500], slurm_job=os.environ.get("SLURM_JOB_ID"),
                slurm_restart=os.environ.get("SLURM_RESTART_COUNT", "0") if "SLURM_JOB_ID" in os.environ else None)


# squeue states of a job whose processes may still be running (anything else, or no entry: they are not).
_SLURM_LIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING",
                      "STAGE_OUT"}


def _slurm_job_running(job_id: str) -> bool | None:
  """Whether squeue lists the job as (possibly) running; None when squeue cannot tell."""
  try:
    out = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T"], capture_output=True,
                         text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  states = {line.strip() for line in out.stdout.splitlines() if line.strip()}
  if out.returncode != 0 and not states:
    # Finished jobs drop out of squeue; some versions then say "Invalid job id specified" and exit 1.
    return False if "invalid job id" in out.stderr.lower() else None
  return bool(states & _SLURM_LIVE_STATES)


def is_alive(holder: Holder) -> bool:
  """Whether the run named by `holder` may still be running (True for another host, unless SLURM says not)."""
  if holder.host != socket.gethostname():
    if not holder.slurm_job:
      return True
    me = this_process()
    if holder.slurm_job == me.slurm_job:  # this very job: alive only if it is this run of it (not a requeue)
      return holder.slurm_restart == me.slurm_restart
    return _slurm_job_running(holder.slurm_job) is not False
  try:
    os.kill(holder.pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # a process of another user: it exists
  start = _start_time(holder.pid)
  return not (holder.start and start and start != holder.start)  # the pid was recycled


def _read(path: str) -> Holder | None:
  try:
    with open(path) as f:
      fields = json.load(f)
    return Holder(**{f.name: fields.get(f.name) for f in dataclasses.fields(Holder)})
  except (OSError, ValueError, TypeError):
    return None  # vanished, or a writer died between creating and filling it


class WorkdirLock:
  """The held lock; `release` removes the file (if it is still ours)."""

  def __init__(self, path: str, holder: Holder):
    self.path, self.holder = path, holder

  def release(self) -> None:
    if _read(self.path) == self.holder:
      os.remove(self.path)

  def __enter__(self) -> WorkdirLock:
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def acquire(workdir: str) -> WorkdirLock:
  """Takes `workdir`'s lock or raises WorkdirLockedError naming the run that holds it."""
  path = os.path.join(workdir, LOCK_NAME)
  me = this_process()
  # Another process may remove or replace the file between our steps: retry, a few times. Waiting for
  # a young unreadable file to be filled (or to age) is not a retry: it used to use up the retries in
  # one second and refuse, blaming "other runs", a file that one dead run had left unfilled.
  retries, patience = 0, time.monotonic() + UNREADABLE_GRACE_S + 5
  while retries < 5:
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      holder = _read(path)
      if holder is None:
        if _age_s(path) < UNREADABLE_GRACE_S and time.monotonic() < patience:  # being written by a run starting now
          time.sleep(0.2)
          continue
        logging.warning("workdir lock: %s is empty or unreadable (left by a run that died while taking "
                        "it); taking the lock over.", path)
      elif is_alive(holder):
        where = ("wait for it to end, or stop it" if holder.host == me.host else
                 f"squeue lists its SLURM job {holder.slurm_job} as running (or cannot say); wait for it to end, "
                 "or delete the lock file if it is known to be dead" if holder.slurm_job else
                 "this run cannot tell whether it is still running; if it is not, delete the lock file")
        raise WorkdirLockedError(
            f"workdir {workdir} is in use by another run ({holder.describe()}; lock file {path}): {where}. "
            "Two runs on one workdir would overwrite each other's logs and checkpoints; give this run "
            "its own --workdir.") from None
      else:
        logging.warning("workdir lock: %s was left by a run that is no longer running (%s); taking the "
                        "lock over.", path, holder.describe())
      _remove_if_unchanged(path, holder)
      retries += 1
      continue
    with os.fdopen(fd, "w") as f:
      json.dump(dataclasses.asdict(me), f)
      f.flush()
      os.fsync(f.fileno())
    return WorkdirLock(path, me)
  raise WorkdirLockedError(f"workdir {workdir}: could not take the lock {path} (other runs keep taking "
                           "it); start one run per workdir.")


def _remove_if_unchanged(path: str, holder: Holder | None) -> None:
  # Only the lock we judged stale: if another starting run replaced it meanwhile, leave that one.
  if _read(path) == holder:
    try:
      os.remove(path)
    except FileNotFoundError:
      pass


def _age_s(path: str) -> float:
  try:
    return time.time() - os.path.getmtime(path)
  except OSError:
    return 0.0


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[WorkdirLock | None]:
  """Holds `workdir`'s lock for the `with` body; every process of a job calls it.

  Process 0 takes the lock (the workdir is one directory whoever writes it); in a multi-process job
  the others learn its outcome through one all-gather of a flag, so that all of them refuse together
  instead of waiting in the first collective for a process that has stopped.
  """
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = acquire(workdir)
    except WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1:
    refused = bool(np.max(multihost_utils.process_allgather(np.int32(error is not None))))
    if refused and error is None:
      if lock is not None:
        lock.release()
      raise WorkdirLockedError(f"workdir {workdir} is in use by another run (process 0's log names it).")
  if error is not None:
    raise error
  try:
    yield lock
  finally:
    if lock is not None:
      lock.release()
