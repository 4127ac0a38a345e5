#!/usr/bin/env bash
# Installs Debian packages with apt-get (as root, or through sudo):
# scripts/apt-install.sh PACKAGE...
set -euo pipefail

if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-install.sh: apt-get not found; install $* yourself" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi

echo "==> installing $* (apt-get)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@"
