#!/usr/bin/env bash
# Create .venv (if needed) and install regen into it. Torch goes first and pinned: an
# unpinned torch would make pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[dev]${REGEN_EXTRAS:+,$REGEN_EXTRAS}"
python -c "import regen, torch; print(f'regen {regen.__version__} ready (torch {torch.__version__})')"
