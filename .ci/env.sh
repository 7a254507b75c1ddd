#!/usr/bin/env bash
# Run a command inside autopar's local virtual environment, creating it first if needed.
#   bash .ci/env.sh autopar graph --model gpt-small
#   bash .ci/env.sh python -m pytest
# Idempotent: the venv (.venv) is made once; the package is reinstalled only when
# pyproject.toml changes. torch is installed only when none is importable, and then as
# the CPU build (torch==2.13.0), so pip never pulls a multi-GB CUDA build by accident.
# A torch you installed yourself (e.g. a CUDA build) is kept: set AUTOPAR_PYTHON to that
# interpreter to use it instead of .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${AUTOPAR_PYTHON:-}"
if [ -z "$py" ]; then
  if [ ! -x .venv/bin/python ]; then
    base="$(command -v python3.11 || command -v python3)"
    "$base" -m venv .venv
  fi
  py="$root/.venv/bin/python"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "[autopar] installing the CPU build of torch 2.13.0" >&2
  extra=()
  if [ "$(uname -s)" = Linux ] && ! ls /opt/wheels/torch-2.13.0* >/dev/null 2>&1; then
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "$py" -m pip install -q "${extra[@]}" torch==2.13.0
fi
stamp="$(dirname "$py")/../.autopar-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ] || ! "$py" -c "import planner, pulp, hypothesis" >/dev/null 2>&1; then
  echo "[autopar] installing autopar and its dependencies into $(dirname "$py")/.." >&2
  "$py" -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$(dirname "$py"):$PATH"
exec "$@"
