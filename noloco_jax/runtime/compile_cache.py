"""JAX's persistent compilation cache, on by default for every entry point (main.py, notebooks, scripts).

A restarted or resumed job, or the next run of a sweep, then loads its compiled programs from disk
instead of compiling them again (experiments/RESULTS.md: time to the first step, cold vs warm). Only
speed changes: an entry is keyed by the program, the devices, the compile options and the JAX/XLA
versions, so a changed program simply misses.

Where (first that is set):
  1. the `path` argument (main.py's --compile_cache flag);
  2. the environment variable NOLOCO_COMPILE_CACHE;
  3. JAX's own setting (JAX_COMPILATION_CACHE_DIR or jax.config), left as it is;
  4. ~/.cache/noloco_jax/jax_compile_cache.
An empty string, "0", "off" or "none" (as argument or variable) turns the cache off.

Call `enable` before the process compiles anything: JAX sets its cache up once, at the first compile,
and later changes of the directory are not seen by it.
"""

from __future__ import annotations

import os

import jax

ENV = "NOLOCO_COMPILE_CACHE"
DEFAULT = "~/.cache/noloco_jax/jax_compile_cache"
_OFF = ("", "0", "off", "none", "false")
# Programs that compile faster than this are not written (each entry costs a file write and, on a
# shared file system, a round trip; the default job's small programs compile in ~0.1-1 s on CPU).
MIN_COMPILE_TIME_S = 0.2


def resolve(path: str | None = None) -> str | None:
  """The cache directory the rules above give, or None when the cache is off."""
  if path is None:
    path = os.environ.get(ENV)
  if path is None:
    path = jax.config.jax_compilation_cache_dir or DEFAULT
  if path.strip().lower() in _OFF:
    return None
  return os.path.abspath(os.path.expanduser(path))


def enable(path: str | None = None) -> str | None:
  """Points JAX's persistent cache at `resolve(path)`; returns the directory, or None when off."""
  directory = resolve(path)
  if directory is None:
    return None
  if path is None and os.environ.get(ENV) is None and jax.config.jax_compilation_cache_dir:
    return directory  # JAX's own setting (rule 3), with its own thresholds: left as it is
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # a user's threshold wins
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  return directory
