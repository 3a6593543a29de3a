# Sourced by the other scripts: creates .venv beside the repository (once) and installs the project
# into it, with the test tools when NOLOCO_EXTRAS=test, and jax for an accelerator when
# NOLOCO_JAX=cuda13 | cuda12 | tpu (default: CPU jax). Re-installs only when setup.py or these change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NOLOCO_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${NOLOCO_EXTRAS:-}"
JAX_KIND="${NOLOCO_JAX:-}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
STAMP="$VENV/.noloco_installed_$(sha1sum "$ROOT/setup.py" | cut -c1-12)${EXTRAS:+_$EXTRAS}${JAX_KIND:+_$JAX_KIND}"
if [ ! -f "$STAMP" ]; then
  echo "Installing noloco_jax${EXTRAS:+[$EXTRAS]}${JAX_KIND:+ with jax[$JAX_KIND]} into $VENV (first run: a few minutes) ..."
  # jax[KIND] within setup.py's jax range: pip resolves both requirements together.
  "$VENV/bin/pip" install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}" ${JAX_KIND:+"jax[$JAX_KIND]"}
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
