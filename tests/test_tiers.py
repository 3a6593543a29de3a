"""The test tiers of tests/conftest.py, on throw-away test files run by pytest in a subprocess: a test
marked `exhaustive(reason=...)` leaves the default run and comes back with NOLOCO_TESTS=all (and when its
file is named); a misspelt tier marker, or `exhaustive` without a reason, fails the collection instead
of letting the test run silently in the default tier."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIERED = '''
import pytest

def test_always():
  pass

@pytest.mark.exhaustive(reason="test_always proves the same")
def test_costly():
  pass

@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.exhaustive(reason="f32 stays"))])
def test_case(dtype):
  pass
'''


def _pytest(tmp_path, files: dict[str, str], *args, tier: str = ""):
  """pytest on `files` in a directory of their own, with a copy of this suite's conftest.py."""
  shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  env = {k: v for k, v in os.environ.items() if k not in ("NOLOCO_TESTS", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
  if tier:
    env["NOLOCO_TESTS"] = tier
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                         "--rootdir", str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)


def test_exhaustive_tests_leave_the_default_run_and_come_back_with_all(tmp_path):
  default = _pytest(tmp_path, {"test_t.py": TIERED}, "-v", ".")
  assert default.returncode == 0, default.stdout + default.stderr
  assert "2 passed, 2 deselected" in default.stdout, default.stdout
  assert "test_always PASSED" in default.stdout and "test_case[float32] PASSED" in default.stdout
  every = _pytest(tmp_path, {"test_t.py": TIERED}, "-v", ".", tier="all")
  assert every.returncode == 0 and "4 passed" in every.stdout, every.stdout + every.stderr
  named = _pytest(tmp_path, {"test_t.py": TIERED}, "test_t.py")  # a file named on the command line runs whole
  assert named.returncode == 0 and "4 passed" in named.stdout, named.stdout + named.stderr


def test_a_misspelt_tier_marker_fails_the_collection(tmp_path):
  typo = "import pytest\n\n@pytest.mark.exhaustve(reason='typo')\ndef test_x():\n  pass\n"
  done = _pytest(tmp_path, {"test_typo.py": typo}, ".")
  assert done.returncode != 0, done.stdout
  assert "exhaustve" in done.stdout + done.stderr and "passed" not in done.stdout, done.stdout


def test_exhaustive_without_a_reason_is_a_usage_error(tmp_path):
  bare = "import pytest\n\n@pytest.mark.exhaustive\ndef test_x():\n  pass\n"
  done = _pytest(tmp_path, {"test_bare.py": bare}, ".")
  assert done.returncode != 0, done.stdout
  assert "test_bare.py::test_x: @pytest.mark.exhaustive needs reason=" in done.stdout + done.stderr
