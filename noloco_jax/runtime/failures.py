"""How a failed run ends: its cause in a few lines, and a last line saying what happened and what to do.

A user reads the first and the last lines of a failed run. Three things used to bury them:

- Orbax's asynchronous machinery, after a failed read or write, leaves tensorstore callbacks that
  fire on a closed asyncio loop: each prints a `RuntimeError: Event loop is closed` traceback through
  `sys.unraisablehook` (hundreds for a small model, tens of thousands for a large one).
  `quiet_orbax_noise` installs a hook that drops exactly those and passes everything else on.
- Orbax logs the full traceback of a failed background write; the run's own error (the checkpointer's)
  names the cause again, so orbax's records keep their first line and lose the traceback.
- At interpreter shutdown, the coroutines of an abandoned write are finalised after the import system
  is gone (`ImportError: sys.meta_path is None` x hundreds). `exit_on_failure` (main.py) prints the
  error and leaves with os._exit once the run has settled its checkpoint, so no finaliser runs.

Errors of the `ReportedError` kind already say what happened and what to do: they are printed as one
line, without a traceback; so are an interrupt (SIGINT: exit status 130) and a workdir that cannot be
written. Any other exception is a bug or an unforeseen failure: its traceback is printed, then the
same kind of last line. The last line advises a resume only where a checkpoint exists to resume from.
"""

from __future__ import annotations

import contextlib
import errno
import logging as py_logging
import os
import sys
import traceback
from collections.abc import Iterator

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class ReportedError(Exception):
  """An error whose message names the cause and the remedy; reported as one line, no traceback.

  `then_go_on`: the remedy is followed by a rerun, which `report` names from what the workdir holds
  (resume from its last checkpoint, or start again where it holds none): the code that raises the error
  does not know the workdir, and advice to resume from a checkpoint that does not exist misleads.
  """
  then_go_on = False


def _is_closed_loop_noise(unraisable) -> bool:
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
  return bool(frames) and frames[-1].filename.endswith(os.path.join("asyncio", "base_events.py"))


def quiet_orbax_noise() -> None:
  """Drops the closed-event-loop callbacks of abandoned orbax reads and writes (idempotent)."""
  previous = sys.unraisablehook
  if getattr(previous, "_noloco_quiet", False):
    return

  def hook(unraisable):
    if not _is_closed_loop_noise(unraisable):
      previous(unraisable)

  hook._noloco_quiet = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _orbax_path(filename: str) -> bool:
  return f"{os.sep}orbax{os.sep}" in filename


def _from_orbax(record: py_logging.LogRecord) -> bool:
  """Logged by orbax, or by asyncio about an orbax coroutine (`Task exception was never retrieved`
  for the other fragments of a failed write: their traceback ends in orbax's serialization code)."""
  if _orbax_path(record.pathname):
    return True
  tb = record.exc_info[2] if record.exc_info else None
  return tb is not None and any(_orbax_path(frame.filename) for frame in traceback.extract_tb(tb))


class QuietOrbaxLog(py_logging.Filter):
  """Orbax's records in absl's log (and asyncio's about orbax's tasks): INFO dropped (some thirty per
  save); warnings and errors keep their message's first line but not their traceback (the run's own
  error repeats the cause)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not _from_orbax(record):
      return True
    if record.levelno < py_logging.WARNING:
      return False
    if record.exc_info or "\n" in record.getMessage():
      record.msg, record.args = record.getMessage().split("\n", 1)[0][:500], None
      record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def first_line(error: BaseException, limit: int = 400) -> str:
  """`Type: first line of the message`, its middle cut out past `limit` characters (the operating
  system's reason, e.g. "No space left on device", comes last in tensorstore's messages)."""
  text = str(error).strip().split("\n", 1)[0]
  if len(text) > limit:
    text = text[:limit // 2] + " ... " + text[-limit // 2:]
  return f"{type(error).__name__}: {text}"


def last_checkpoint(workdir: str | None) -> int | None:
  """The latest complete checkpoint step in `workdir` (orbax renames a step's directory to its number
  only when it is complete), or None."""
  try:
    steps = [int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
  except (OSError, TypeError):
    return None
  return max(steps) if steps else None


def _advice(workdir: str | None) -> str:
  """What to run next: resume where a checkpoint exists, else start again (never "resume" from nothing)."""
  if workdir is None:
    return "run the same command again"
  step = last_checkpoint(workdir)
  if step is None:
    return f"run the same command to start again ({workdir} holds no checkpoint yet)"
  return f"run the same command to resume from the last checkpoint (step {step} in {workdir})"


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def _cannot_write_workdir(error: BaseException, workdir: str | None) -> bool:
  """An OSError of a path in (or above) the workdir that says it cannot be written."""
  if not (isinstance(error, OSError) and error.errno in _UNWRITABLE and error.filename and workdir):
    return False
  path, root = os.path.abspath(str(error.filename)), os.path.abspath(workdir)
  return path == root or path.startswith(root + os.sep) or root.startswith(path + os.sep)


def report(error: BaseException, workdir: str | None) -> tuple[str, int, bool]:
  """(the run's last line after `noloco_jax: error: `, exit status, whether the traceback helps)."""
  if isinstance(error, KeyboardInterrupt):
    return f"interrupted (SIGINT, e.g. Ctrl-C). To go on, {_advice(workdir)}.", EXIT_INTERRUPTED, False
  if isinstance(error, ReportedError):
    return str(error) + (f" Then {_advice(workdir)}." if error.then_go_on else ""), EXIT_FAILED, False
  if _cannot_write_workdir(error, workdir):
    return (f"cannot write to the workdir {workdir}: {first_line(error)}. Give --workdir a directory this user "
            "can create and write to (not on a read-only filesystem)."), EXIT_FAILED, False
  return (f"the run failed with {first_line(error)} (traceback above). Fix the cause and {_advice(workdir)}.",
          EXIT_FAILED, True)


class _Run:
  workdir: str | None = None  # the workdir of the run inside exit_on_failure (for distributed.fail_fast)


def run_workdir() -> str | None:
  """The workdir of the run main.py is running (inside `exit_on_failure`), else None."""
  return _Run.workdir


_BEFORE_EXIT: list = []  # called by exit_now once the last line is out (before_exit_now)


def before_exit_now(fn) -> None:
  """Registers `fn()` to run when `exit_now` leaves, after the last line is printed (an asynchronous
  process says it is done, and tells its sidecar that its last line was its own: runtime/sidecar.py)."""
  if fn not in _BEFORE_EXIT:
    _BEFORE_EXIT.append(fn)


def exit_now(error: BaseException, traceback_printed: bool = False) -> None:
  """Prints the run's cause (its traceback where that helps) and last line, then exits at once."""
  message, status, helps = report(error, _Run.workdir)
  if helps and not traceback_printed:
    traceback.print_exception(error)
  print(f"noloco_jax: error: {message}", file=sys.stderr)
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  for fn in _BEFORE_EXIT:
    try:
      fn()
    except Exception:  # pylint: disable=broad-except  (the run's own error is what the user must read)
      pass
  # The run has settled its checkpoint (loop.py); skip the interpreter's finalisers (see above).
  os._exit(status)  # pylint: disable=protected-access


@contextlib.contextmanager
def exit_on_failure(workdir: str | None) -> Iterator[None]:
  """main.py: a failed or interrupted run prints its cause and one last line, then exits at once
  (status 1; 130 after SIGINT, as a shell reports a command stopped by Ctrl-C)."""
  _Run.workdir = workdir
  try:
    yield
  except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-except
    exit_now(e)
  finally:
    _Run.workdir = None
