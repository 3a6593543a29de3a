#!/usr/bin/env bash
# The accelerator check (experiments/lib/accelerator_check.py; docs/accelerator_check.md): on a machine with a
# GPU, the figures of this code base there within 8 minutes, into one JSON file.
#
#   bash scripts/accelerator_check.sh                          # installs into .venv with jax[cuda13] (network)
#   NOLOCO_JAX=cuda12 bash scripts/accelerator_check.sh        # ... with jax[cuda12]
#   bash scripts/accelerator_check.sh --offline-wheels .whl    # no network: the machine's own jax, plus wheels
#   bash scripts/accelerator_check.sh --no-install             # the python3 on PATH, as it is
#   bash scripts/accelerator_check.sh --cpu --no-install       # tiny sizes on the CPU (tests/test_accelerator_check.py)
#
# How it installs (one of):
#   default            scripts/env.sh: .venv beside the repository, `pip install -e .` with jax[$NOLOCO_JAX]
#                      (cuda13 unless set; with --cpu, CPU jax).
#   --offline-wheels DIR  for a machine without a network whose python3 already has jax for its GPU (and
#                      whatever else it has): of the wheels in DIR, those whose package that python lacks or
#                      holds outside setup.py's range go with `pip --no-index --no-deps` into a directory of
#                      their own ($NOLOCO_SITE, default /tmp/noloco_site), first on PYTHONPATH with the checkout.
#   --no-install       nothing: the python3 on PATH must already import the project.
#   --download-wheels DIR  fetches the wheels of scripts/accelerator_check_wheels.txt into DIR for
#                      --offline-wheels (on a machine with a network), and exits.
# Every other argument goes to experiments/lib/accelerator_check.py (--out, --budget_s, --only, --overwrite).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INSTALL=venv
WHEELS=""
CPU=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1; ARGS+=("$1") ;;
    --no-install) INSTALL=none ;;
    --offline-wheels) INSTALL=wheels; WHEELS="${2:?--offline-wheels needs a directory of wheels}"; shift ;;
    --offline-wheels=*) INSTALL=wheels; WHEELS="${1#*=}" ;;
    --download-wheels) INSTALL=download; WHEELS="${2:?--download-wheels needs a directory}"; shift ;;
    --download-wheels=*) INSTALL=download; WHEELS="${1#*=}" ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
export PYTHONUNBUFFERED=1
case "$INSTALL" in
  venv)
    [ -n "$CPU" ] || export NOLOCO_JAX="${NOLOCO_JAX:-cuda13}"
    source "$ROOT/scripts/env.sh"
    PY=python ;;
  wheels)
    PY="${PYTHON:-python3}"
    SITE="${NOLOCO_SITE:-/tmp/noloco_site}"
    [ -d "$WHEELS" ] || { echo "accelerator_check: --offline-wheels=$WHEELS is not a directory." >&2; exit 2; }
    echo "accelerator_check: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'), wheels from $WHEELS:"
    # Only what this Python lacks, or holds outside setup.py's ranges (experiments/lib/accelerator_check.py says why).
    if ! PICKED="$(cd "$ROOT" && "$PY" -m experiments.lib.accelerator_check --pick_wheels "$(cd "$WHEELS" && pwd)")"; then
      echo "accelerator_check: could not choose among the wheels (above); installing them all." >&2
      PICKED="$(ls -d "$(cd "$WHEELS" && pwd)"/*.whl)"
    fi
    mapfile -t FILES <<< "$PICKED"
    if [ -n "$PICKED" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${FILES[@]}"
    fi
    # The project itself is imported from the checkout (as `pip install -e .` would): scripts run as files
    # (experiments/bench_*.py, the asynchronous job's processes) import it by name from PYTHONPATH.
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" ;;
  download)
    # For --offline-wheels on another machine: scripts/accelerator_check_wheels.txt's pins, each without its
    # dependencies (the file names every one needed), as wheels for that machine's Python on x86-64 Linux.
    # A package published only as source (promise) is built here into a pure-Python wheel.
    mkdir -p "$WHEELS"
    PYV="${NOLOCO_WHEEL_PYTHON:-3.12}"
    PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    grep -v '^#' "$ROOT/scripts/accelerator_check_wheels.txt" | while read -r PIN; do
      [ -n "$PIN" ] || continue
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
          "${PLATFORMS[@]}" -d "$WHEELS" "$PIN" 2>/dev/null || python3 -m pip wheel -q --no-deps -w "$WHEELS" "$PIN"
    done
    echo "accelerator_check: $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS"
    exit 0 ;;
  none)
    PY="${PYTHON:-python3}"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
cd "$ROOT"
exec "$PY" -m experiments.lib.accelerator_check ${ARGS[@]+"${ARGS[@]}"}
