"""Last words for a process of an asynchronous job that JAX's runtime ends without a word of ours.

Why. A process of an asynchronous job holds a client of the job's coordination service
(asynchronous/control.py). When the service goes away (the process hosting it died or exited, or the
standalone service process died), or when the service has held this process dead (it was stopped or
starved for longer than heartbeat_timeout_s), the client's own thread aborts the process: a C++
LOG(FATAL), a stack dump and Python's fault dump, 170-odd lines, exit status 134, and no line of ours.
Nothing inside the process can prevent that or speak after it: the runtime's hook for that moment cannot
take a Python function (runtime/peer_watch.py), and the abort comes from a thread of the runtime's own.

So a small process stands beside it (`start`): this module, run with the read end of a pipe whose write
end only the training process holds. The training process writes "bye" on every way out it controls
(`goodbye`: after its own last line, or at a normal end). When the pipe closes without it, the process
died without a word: the sidecar looks at the coordination service (can its address still be reached?)
and at the process's checkpoints, and prints the last line: what happened, which process hosted the
service, the last checkpoint, and the command that goes on. It is not the training process's parent:
the pid a launcher or a user signals, SIGSTOP, and the exit status stay the training process's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

from noloco_jax.runtime import failures

_BYE = b"bye\n"
_state: dict = {}  # the write end of the pipe ("pipe") and the sidecar's Popen ("proc"), once started


def start(*, slot: int, num_processes: int, address: str, standalone_service: bool, workdir: str,
          heartbeat_timeout_s: int) -> None:
  """Starts the sidecar of this process (`workdir`: its own, WORKDIR/process_<slot>)."""
  if _state:
    return
  context = dict(slot=slot, num_processes=num_processes, address=address, standalone_service=standalone_service,
                 workdir=os.path.abspath(workdir), heartbeat_timeout_s=heartbeat_timeout_s)
  read, write = os.pipe()  # neither end is inherited by other children (wandb, ...): only the sidecar's, below
  # A session of its own: a Ctrl-C in the terminal is for the training process, not for its sidecar.
  proc = subprocess.Popen([sys.executable, "-m", __name__, str(read), json.dumps(context)], pass_fds=(read,),
                          stdin=subprocess.DEVNULL, start_new_session=True)
  os.close(read)
  _state.update(pipe=write, proc=proc)
  failures.before_exit_now(goodbye)  # a failed run's way out: its own last line is printed first
  import atexit  # pylint: disable=g-import-not-at-top
  atexit.register(goodbye)  # an ordinary end of the interpreter


def goodbye() -> None:
  """This process leaves with a last line of its own (or none is needed): the sidecar stays silent."""
  pipe = _state.pop("pipe", None)
  if pipe is not None:
    with contextlib.suppress(OSError):
      os.write(pipe, _BYE)
      os.close(pipe)


def service_reachable(address: str, timeout_s: float = 1.0) -> bool:
  """Whether something still accepts connections at the coordination service's `host:port`."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
      return True
  except (OSError, ValueError):
    return False


def last_words(context: dict, reachable: bool) -> str:
  """The last line for a process that died without a word (pure: the tests call it directly)."""
  slot, address, workdir = context["slot"], context["address"], context["workdir"]
  standalone, n = context["standalone_service"], context["num_processes"]
  step = failures.last_checkpoint(workdir)
  saved = (f"Its last checkpoint is step {step} in {workdir}" if step is not None else
           f"It saved no checkpoint yet ({workdir})")
  again = "Start the whole job again with the same command: each process resumes from its own checkpoint"
  if standalone:
    host = f"the job's coordination service at {address}, a process of its own"
    port = address.rpartition(":")[2]
    again = (f"Start the service again (python -m noloco_jax.asynchronous.control --port={port} --num_processes={n}), "
             "then every process with the same command: each process resumes from its own checkpoint")
  else:
    host = f"the job's coordination service at {address}, hosted by process 0"
  if slot == 0 and not standalone:
    return (f"process 0 of the asynchronous job, which hosted its coordination service, ended without a word of its "
            f"own (killed by a signal, or by JAX's runtime: see above); the job's other processes end with it (a limit "
            f"of JAX's runtime: run the service in a process of its own to outlive process 0, docs/async.md §5). "
            f"{saved}. {again}.")
  if not reachable:
    return (f"process {slot} of the asynchronous job was ended by JAX's runtime: {host}, is gone "
            f"(docs/async.md §5). {saved}. {again}.")
  return (f"process {slot} of the asynchronous job ended without a word of its own: killed by a signal, or by JAX's "
          f"runtime (its message above; e.g. stopped or starved for longer than heartbeat_timeout_s="
          f"{context['heartbeat_timeout_s']} s, the service held it dead). {saved}. The job goes on without it: run "
          f"this process's command again (the same process id) to rejoin it.")


def main(argv: list[str]) -> int:
  fd, context = int(argv[1]), json.loads(argv[2])
  for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  with os.fdopen(fd, "rb") as pipe:
    said = pipe.read()  # until the training process has closed it: said goodbye, or died
  if _BYE not in said:
    print(f"noloco_jax: error: {last_words(context, service_reachable(context['address']))}", file=sys.stderr,
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
