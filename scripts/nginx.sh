#!/usr/bin/env bash
# Installs nginx (Debian's `nginx-light`) for the test that runs `keel serve`
# behind it (apps/keel/tests/proxy.rs), if missing.
#
# The package would start nginx on 0.0.0.0:80 as it installs; a policy-rc.d
# that refuses every start keeps it from running at all. The test starts its
# own nginx, on a free loopback port, with deploy/nginx/keel.conf.
set -euo pipefail

if [ -x /usr/sbin/nginx ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  trap '$SUDO rm -f "$policy"' EXIT
fi
"$(dirname "$0")/apt-install.sh" nginx-light
