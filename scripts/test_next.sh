#!/usr/bin/env bash
# The newest supported JAX on the newest supported Python (scripts/env_next.sh: Python 3.13, jax 0.12
# and the flax, optax, orbax, grain and tfds that pip resolves with it): the default job's smoke
# variant through the command line, then the fast unit tests (the math against NumPy, the model,
# configs, the golden smoke run and the tools used after a run). CI (.ci/run) runs it after the main
# suite, which covers the rest on Python 3.11 with jax 0.10. Extra arguments go to pytest.
set -euo pipefail
NOLOCO_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env_next.sh"
python -c "import sys, jax, flax, optax, orbax.checkpoint as o; print(f'test_next: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, orbax-checkpoint {o.__version__}')"
SMOKE_DIR="$(mktemp -d)"
trap 'rm -rf "$SMOKE_DIR"' EXIT
# The tests share one fresh compilation cache, as in scripts/test.sh (a hit only saves time).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$SMOKE_DIR/jax_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
python -m noloco_jax.main --config=configs/default.py:smoke --workdir="$SMOKE_DIR/smoke" 2>&1 | tail -n 9
# Compiled at XLA:CPU's optimisation level 0, as in scripts/test.sh (which says why).
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=${NOLOCO_TEST_XLA_OPT_LEVEL:-0}"
python -m pytest -n "${NOLOCO_TEST_WORKERS:-2}" --dist loadfile --durations=5 \
  tests/test_outer.py tests/test_inner.py tests/test_model.py tests/test_model_interface.py tests/test_losses.py \
  tests/test_stability.py tests/test_pairing_law.py tests/test_routing_law.py tests/test_golden.py \
  tests/test_consensus.py tests/test_profiler.py tests/test_report.py tests/test_sample.py "$@"
