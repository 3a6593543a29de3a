"""Inter-process file locks and atomic file writes for the data caches.

Several processes may prepare the same cache at once (the hosts of a multi-process job on one
machine, pytest-xdist workers). They serialise on an advisory `flock` beside the cache, and every
cache file appears under its final name only once complete (write to a temporary name, then
`os.replace`), so a reader never sees half a file even if a writer dies.
"""

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
  """Holds an exclusive advisory lock on `path` (created if missing) for the `with` body."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
  try:
    # Blocks until the other holder is done; the lock dies with its process, so a crashed
    # writer never leaves the cache locked forever.
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def atomic_write(path: str, write: Callable[[str], None], suffix: str = "") -> None:
  """Calls `write(tmp_path)` and renames the result to `path` in one step.

  `suffix` keeps writers happy that append an extension themselves (np.save adds `.npy`).
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
