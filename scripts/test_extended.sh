#!/usr/bin/env bash
# The extended test tier (pytest marker `extended`): torchrun and Ray runs compared with one
# process, and `regen report` in a real browser. CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Chromium + chromedriver for the browser test of `regen report` (tests/test_report_browser.py,
# which skips without them). Installed only when missing, only where apt-get and root are available.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing chromium and chromium-driver (log in .venv/chromium-install.log)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } \
    >.venv/chromium-install.log 2>&1 || echo "warning: chromium install failed (see .venv/chromium-install.log); the browser test will skip" >&2
fi
. .venv/bin/activate
python -m pytest -m extended "$@"
