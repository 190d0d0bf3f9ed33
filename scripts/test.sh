#!/usr/bin/env bash
# Quickstart (b): set up and run the test suite (the extended tier: scripts/test_extended.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest "$@"
