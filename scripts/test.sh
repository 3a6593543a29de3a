#!/usr/bin/env bash
# The test suite on 8 fake CPU devices (set up in tests/conftest.py). Extra arguments go to pytest.
NOLOCO_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest -n "${NOLOCO_TEST_WORKERS:-2}" --durations=15 tests "$@"
