#!/usr/bin/env bash
# Hygiene a compiler does not check by default:
# - every crate but the test support builds with each of its features
#   alone, and with none (cargo-hack), without a warning, so a feature
#   never leans on another one it does not name;
# - no crate lists a dependency it does not use (cargo-machete).
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in cargo-hack cargo-machete; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "==> installing $tool"
    cargo install --locked "$tool"
  fi
done

echo "==> cargo machete (unused dependencies)"
cargo machete

echo "==> cargo hack check --each-feature (every feature alone)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# keel-testkit is test support only: the tests build it with every feature,
# and its features alone are 10 builds of the slowest half of CI.
cargo hack check --workspace --exclude keel-testkit --each-feature --no-dev-deps >"$log" 2>&1 || status=$?
grep -E '^(info: running|warning|error)' "$log" || true
if [ "$status" -ne 0 ] || grep -qE '^(warning|error)' "$log"; then
  tail -n 60 "$log" >&2
  echo "a feature combination failed to build or warned (see above)" >&2
  exit 1
fi
