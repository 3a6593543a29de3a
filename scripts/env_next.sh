# Sourced like env.sh, for the newest supported JAX on the newest supported Python: a second
# virtualenv, .venv-next beside the repository, made with Python 3.13 (jax 0.12 needs Python >= 3.12,
# so pip resolves the newest jax, flax, optax, orbax, grain and tfds that setup.py allows there).
# Same logic as env.sh (it is env.sh, with another interpreter and directory): NOLOCO_EXTRAS and
# NOLOCO_JAX work as there. PYTHON_NEXT names the interpreter when python3.13 is elsewhere.
ROOT_NEXT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON_NEXT:-}" ]; then
  for candidate in python3.13 "$HOME/.pyenv/versions/3.13.0/bin/python" "$HOME"/.pyenv/versions/3.13*/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
      PYTHON_NEXT="$candidate"
      break
    fi
  done
fi
if [ -z "${PYTHON_NEXT:-}" ]; then
  echo "scripts/env_next.sh: no Python 3.13 found (looked for python3.13 and ~/.pyenv/versions/3.13*); set PYTHON_NEXT=/path/to/python3.13." >&2
  return 1 2>/dev/null || exit 1
fi
NOLOCO_VENV="${NOLOCO_VENV_NEXT:-$ROOT_NEXT/.venv-next}" PYTHON="$PYTHON_NEXT" source "$ROOT_NEXT/scripts/env.sh"
