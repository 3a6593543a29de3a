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
# The tests compile at XLA:CPU's backend optimisation level 0 (LLVM's cheapest passes): compiling is most
# of a test's time here (a cold smoke run: 22 s at the default level, 16 s at level 0). The code is the
# same arithmetic, but some transcendental functions round differently in the last bit, so the golden
# test (tests/test_golden.py) runs its smoke job at the default level, as a user's run compiles.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=${NOLOCO_TEST_XLA_OPT_LEVEL:-0}"
# --all: the exhaustive tier too (tests marked `@pytest.mark.exhaustive(reason=...)`: the benchmarks' quick
# modes, three notebooks, bfloat16 and sibling cases; tests/conftest.py); the default run is what CI runs.
if [ "${1:-}" = "--all" ]; then
  shift
  export NOLOCO_TESTS=all
fi
# Test files named on the command line run alone (`bash scripts/test.sh tests/test_outer.py`); else all of tests/.
TARGETS=(tests)
for arg in "$@"; do
  case "$arg" in tests/*|*/tests/*) TARGETS=() ;; esac
done
# --dist loadfile: each file runs on one worker, so a module-scoped fixture (the trained, killed and
# resumed runs that test_checkpoint, test_elastic, test_export_hf, ... share) is built once per run, not
# once per worker (with pytest 9, xdist's per-group alternative, --dist loadgroup, no longer groups).
python -m pytest -n "${NOLOCO_TEST_WORKERS:-2}" --dist loadfile --durations=15 "${TARGETS[@]}" "$@"
