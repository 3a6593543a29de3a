#!/usr/bin/env bash
# The real-component tier: tests that start and stop a real component themselves (a one-node SLURM
# cluster, etcd members, per-node links shaped with tc in network namespaces), marked
# `@pytest.mark.real`. They need root (and apt-get, to install what is missing); elsewhere each skips
# with one line saying why. CI (.ci/run) runs this tier after the default suite. Extra arguments go to pytest.
set -euo pipefail
NOLOCO_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export NOLOCO_TESTS=real
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=${NOLOCO_TEST_XLA_OPT_LEVEL:-0}"
# libfaketime for the clock-jump test (tests/test_async_exchange_faults.py), installed as root where missing;
# the SLURM and etcd tests install their own components.
if [ ! -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfaketime; } >&2 ||
    echo "test_real: libfaketime could not be installed; its test skips" >&2
fi
TARGETS=(tests)
for arg in "$@"; do
  case "$arg" in tests/*|*/tests/*) TARGETS=() ;; esac
done
# One worker: these tests own machine-wide things (ports, daemons, namespaces) for their duration.
status=0
python -m pytest -n 0 --durations=10 "${TARGETS[@]}" "$@" || status=$?
# pytest's 5 is "no tests collected": a checkout with no real-component tests yet passes.
if [ "$status" -eq 5 ]; then
  echo "test_real: no tests marked real were collected"
  status=0
fi
exit "$status"
