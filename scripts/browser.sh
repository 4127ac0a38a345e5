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

"$(dirname "$0")/apt-install.sh" chromium chromium-driver
