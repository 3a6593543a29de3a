#!/usr/bin/env bash
# The test suite on 8 fake CPU devices (set up in tests/conftest.py). Extra arguments go to pytest.
NOLOCO_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# One persistent compilation cache for the whole run, fresh each time (JAX's own setting, which the
# tests' processes inherit and main.py keeps: noloco_jax/runtime/compile_cache.py): many tests compile
# the same smoke-sized programs, and a hit loads what XLA compiled for the same program, so only time
# changes (6 test files: 228 s -> 184 s). Tests about the cache set their own directory.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t noloco_test_cache.XXXXXX)"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
fi
# --all: the exhaustive tier too (tests/conftest.py EXHAUSTIVE: the benchmarks' quick modes, three
# notebooks, bfloat16 and sibling cases); the default run is what CI runs.
if [ "${1:-}" = "--all" ]; then
  shift
  export NOLOCO_TESTS=all
fi
python -m pytest -n "${NOLOCO_TEST_WORKERS:-2}" --durations=15 tests "$@"
