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
line, without a traceback. Any other exception is a bug or an unforeseen failure: its traceback is
printed, then the same kind of last line.
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import os
import sys
import traceback
from collections.abc import Iterator

EXIT_FAILED = 1


class ReportedError(Exception):
  """An error whose message names the cause and the remedy; reported as one line, no traceback."""


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


@contextlib.contextmanager
def exit_on_failure(workdir: str) -> Iterator[None]:
  """main.py: a failed run prints its cause and a last line, then exits with status 1 at once."""
  try:
    yield
  except KeyboardInterrupt:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, ReportedError):
      message = str(e)
    else:
      traceback.print_exc()
      message = (f"the run failed with {first_line(e)} (traceback above). Fix the cause and run the same "
                 f"command to resume from the last checkpoint in {workdir}.")
    print(f"noloco_jax: error: {message}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
      stream.flush()
    # The run has settled its checkpoint (loop.py); skip the interpreter's finalisers (see above).
    os._exit(EXIT_FAILED)  # pylint: disable=protected-access
