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
log=.venv/setup.log
quiet() {  # pip's build chatter goes to the log, shown only if something fails
  "$@" >"$log" 2>&1 || { cat "$log"; echo "setup failed: $*" >&2; exit 1; }
}
echo "setting up .venv (torch, then regen and its dependencies; log in $log)"
# byte-compiled at install (pip's default): where PYTHONDONTWRITEBYTECODE is set, as on our CI machines,
# nothing is compiled later, and every process would compile torch and transformers from source
quiet python -m pip install --disable-pip-version-check --upgrade pip
quiet python -m pip install --disable-pip-version-check "torch==2.13.0"
quiet python -m pip install --disable-pip-version-check -e ".[dev]${REGEN_EXTRAS:+,$REGEN_EXTRAS}"
python -c "import regen, torch; print(f'regen {regen.__version__} ready (torch {torch.__version__})')"
