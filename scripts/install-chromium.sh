#!/usr/bin/env bash
# Debian's chromium for the browser tests of `miles-env view` (tests/test_view_browser.py).
# Playwright (pip, the dev extra) drives it through `executable_path`: Playwright's own browser
# download is not used. Idempotent; prints the binary's path.
set -euo pipefail
find_chromium() { command -v chromium || command -v chromium-browser || true; }
if [ -z "$(find_chromium)" ]; then
    [ "$(id -u)" = 0 ] || { echo "[chromium] chromium is missing and only root can apt-get install it" >&2; exit 2; }
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core) >/dev/null
fi
find_chromium
