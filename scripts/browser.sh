#!/usr/bin/env bash
# Installs headless Chromium and its WebDriver (Debian's `chromium` and
# `chromium-driver`) for the operator console's browser tests, if missing.
#
# The browser tests start /usr/bin/chromedriver themselves on a free loopback
# port; they skip when it is missing (and fail when CI is set).
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "browser.sh: apt-get not found; install chromium and chromedriver yourself" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi

echo "==> installing chromium and chromium-driver (apt-get)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  chromium chromium-driver
