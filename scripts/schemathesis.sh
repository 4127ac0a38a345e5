#!/usr/bin/env bash
# Installs Schemathesis (the schema-driven API fuzzer the OpenAPI test runs
# against `keel serve`) into a virtualenv of its own, from PyPI, if missing,
# and prints the path of its executable.
set -euo pipefail

VERSION=4.32.5
VENV="${KEEL_TOOLS_DIR:-${HOME}/.cache/keel}/schemathesis-${VERSION}"
BIN="${VENV}/bin/schemathesis"

if [ ! -x "${BIN}" ]; then
  echo "==> installing schemathesis ${VERSION} (pip, into ${VENV})" >&2
  python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install --quiet --disable-pip-version-check "schemathesis==${VERSION}" >&2
fi
echo "${BIN}"
