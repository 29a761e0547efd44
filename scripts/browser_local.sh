#!/usr/bin/env bash
# A headless browser for tests/test_explore.py (python -m decode.explore's page): Debian's chromium and
# its chromedriver, which selenium (the test extra) drives.
#
#     sudo bash scripts/browser_local.sh      # idempotent: installs only what is missing
#
# Both come from Debian's own packages (chromium, chromium-driver), so nothing is downloaded from a
# browser vendor, and the two always match. Where apt cannot install them (no root, no Debian, no
# network), it says so and exits non-zero; the browser tests then skip, naming what is missing.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
if { have chromium || have chromium-browser || have google-chrome; } && have chromedriver; then
  echo "[browser] $( (chromium --version || chromium-browser --version || google-chrome --version) 2>/dev/null | head -1) and chromedriver are installed"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "browser_local.sh: run as root (it installs chromium and chromium-driver with apt)" >&2
  exit 1
fi
if ! have apt-get; then
  echo "browser_local.sh: no apt-get: install Chromium and a matching chromedriver yourself" >&2
  exit 1
fi
echo "[browser] installing chromium and chromium-driver with apt"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
echo "[browser] $(chromium --version 2>/dev/null | head -1) and $(chromedriver --version 2>/dev/null | head -1)"
