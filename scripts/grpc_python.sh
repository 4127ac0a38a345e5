#!/usr/bin/env bash
# Installs Python's gRPC (grpcio, its protoc and its health client: the
# standard client of another language the shipping service must talk to)
# into a virtualenv of its own, from PyPI, if missing, and prints the path
# of its python.
set -euo pipefail

GRPCIO=1.76.0
VENV="${KEEL_TOOLS_DIR:-${HOME}/.cache/keel}/grpcio-${GRPCIO}"
BIN="${VENV}/bin/python"

if [ ! -x "${BIN}" ] || ! "${BIN}" -c "import grpc_tools, grpc_health" 2>/dev/null; then
  echo "==> installing grpcio ${GRPCIO} (pip, into ${VENV})" >&2
  python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install --quiet --disable-pip-version-check \
    "grpcio==${GRPCIO}" "grpcio-tools==${GRPCIO}" "grpcio-health-checking==${GRPCIO}" >&2
fi
echo "${BIN}"
