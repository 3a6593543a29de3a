"""The profiler plug-in (training/plugins/profiler.py): a trace of exactly the chosen steps, written where documented."""

import glob
import gzip
import json
import os
import types

import jax
import jax.numpy as jnp
import pytest

from noloco_jax.training.plugins import profiler


def test_parse_steps_and_its_one_line_errors():
  assert profiler.parse_steps("") is None
  assert profiler.parse_steps("10,12") == (10, 12)
  assert profiler.parse_steps(" 7 ") == (7, 7)
  for bad in ("12,10", "0,3", "a,b", "1,2,3"):
    with pytest.raises(ValueError, match=r"^profile_steps=.*give 'FIRST,LAST'"):
      profiler.parse_steps(bad)
  with pytest.raises(ValueError, match="<= num_steps=12"):
    profiler.parse_steps("10,20", num_steps=12)


def _drive(tmp_path, first, last, begun=0, steps=8):
  """A fake loop: a jitted named step per iteration, the plug-in's hooks in the loop's order."""
  @jax.jit
  def marked_step(x):
    return jnp.tanh(x @ x) + 1.0

  run = types.SimpleNamespace(loop=types.SimpleNamespace(step=begun), state=jnp.ones((64, 64)), on_exit=lambda closer: None)
  plug = profiler.Profiler(str(tmp_path), first, last)
  plug.start(run)
  for step in range(begun + 1, steps + 1):
    run.state = marked_step(run.state)
    run.loop.step = step
    plug.after_step(run, step, {})
  plug.end(run)
  plug.close()
  return plug


def test_the_trace_holds_the_chosen_steps_and_opens_in_both_viewers(tmp_path):
  plug = _drive(tmp_path, 3, 5)
  assert plug.recorded == (3, 5) and not plug.active
  xplane = glob.glob(os.path.join(tmp_path, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  assert len(xplane) == 1 and os.path.getsize(xplane[0]) > 0
  perfetto = glob.glob(os.path.join(tmp_path, "profile", "plugins", "profile", "*", "*perfetto_trace.json.gz"))
  assert len(perfetto) == 1
  with gzip.open(perfetto[0]) as f:
    trace = json.load(f)
  names = {e.get("name", "") for e in trace["traceEvents"]}
  # The jitted step ran three times inside the trace; its name is in the events.
  assert any("marked_step" in n for n in names), sorted(names)[:20]


def test_a_range_from_step_one_and_a_resume_inside_the_range(tmp_path):
  assert _drive(tmp_path / "a", 1, 2).recorded == (1, 2)
  assert _drive(tmp_path / "b", 3, 6, begun=4).recorded == (5, 6)  # resumed after step 4
  assert _drive(tmp_path / "c", 3, 4, begun=6).recorded is None  # resumed past it: no trace
  assert _drive(tmp_path / "d", 6, 20, steps=8).recorded == (6, 8)  # the run ends inside: stopped at its end
