# Sourced by the other scripts: creates .venv beside the repository (once) and installs the project
# into it, with the test tools when NOLOCO_EXTRAS=test. Re-installs only when setup.py changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NOLOCO_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${NOLOCO_EXTRAS:-}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
STAMP="$VENV/.noloco_installed_$(sha1sum "$ROOT/setup.py" | cut -c1-12)${EXTRAS:+_$EXTRAS}"
if [ ! -f "$STAMP" ]; then
  echo "Installing noloco_jax${EXTRAS:+[$EXTRAS]} into $VENV (first run: a few minutes) ..."
  "$VENV/bin/pip" install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
cd "$ROOT"
