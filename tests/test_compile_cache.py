"""The persistent compilation cache (runtime/compile_cache.py): where it goes, how it is turned off, and
that a program compiled by one process is loaded from it (a cache hit) by the next."""

import os
import subprocess
import sys

import jax
import pytest

from noloco_jax.runtime import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def restore_jax_config():
  saved = {k: getattr(jax.config, k) for k in _OPTIONS}
  yield
  for k, v in saved.items():
    jax.config.update(k, v)


def test_resolution_order(monkeypatch, tmp_path, restore_jax_config):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  jax.config.update("jax_compilation_cache_dir", None)
  assert compile_cache.resolve() == os.path.expanduser(compile_cache.DEFAULT)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))  # JAX's own setting is kept
  assert compile_cache.resolve() == str(tmp_path / "jax")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
  assert compile_cache.resolve() == str(tmp_path / "env")
  assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
  for off in ("", "off", "0", "None"):
    assert compile_cache.resolve(off) is None
    monkeypatch.setenv(compile_cache.ENV, off)
    assert compile_cache.resolve() is None
    assert compile_cache.enable() is None


_PROGRAM = """
import sys, jax, jax.numpy as jnp
from noloco_jax.runtime import compile_cache
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e == "/jax/compilation_cache/cache_hits"))
compile_cache.enable(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this tiny program compiles fast
jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.25).lower(jnp.ones((8, 8))).compile()
print("HIT" if any(hits) else "MISS")
"""


def test_a_restarted_process_reads_its_program_from_the_cache(tmp_path):
  """Fresh processes, as a restarted job is: JAX sets its cache up once per process, at first compile."""
  directory = str(tmp_path / "cache")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")

  def run():
    out = subprocess.run([sys.executable, "-c", _PROGRAM, directory], env=env, cwd=ROOT, text=True,
                         capture_output=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-1]

  assert run() == "MISS"
  assert os.listdir(directory), "the compiled program was not written"
  assert run() == "HIT"
