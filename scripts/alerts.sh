#!/usr/bin/env bash
# Checks the shipped Prometheus alert rules (deploy/prometheus) with promtool,
# from Debian's prometheus package (installed when missing): the rules parse,
# and each alert fires on the series that mean trouble and stays quiet on
# those that do not (keel-alerts.test.yml).
set -euo pipefail
cd "$(dirname "$0")/../deploy/prometheus"

if ! command -v promtool >/dev/null 2>&1; then
  echo "==> installing promtool from Debian's prometheus package" >&2
  sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

promtool check rules keel-alerts.yml
promtool test rules keel-alerts.test.yml
