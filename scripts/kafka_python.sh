#!/usr/bin/env bash
# Installs confluent-kafka (Confluent's Python client: the foreign Kafka
# client keel-kafka's interop test produces and consumes with) into a
# virtualenv of its own, from PyPI, if missing, and prints the path of its
# python. Debian's kcat links librdkafka 2.0, which cannot talk to tansu.
set -euo pipefail

CONFLUENT_KAFKA=2.12.1
VENV="${KEEL_TOOLS_DIR:-${HOME}/.cache/keel}/confluent-kafka-${CONFLUENT_KAFKA}"
BIN="${VENV}/bin/python"

if [ ! -x "${BIN}" ] || ! "${BIN}" -c "import confluent_kafka" 2>/dev/null; then
  echo "==> installing confluent-kafka ${CONFLUENT_KAFKA} (pip, into ${VENV})" >&2
  python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install --quiet --disable-pip-version-check "confluent-kafka==${CONFLUENT_KAFKA}" >&2
fi
echo "${BIN}"
