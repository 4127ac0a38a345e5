#!/usr/bin/env bash
# Installs protoc and its well-known types (Debian's `protobuf-compiler` and
# `libprotobuf-dev`, which holds google/protobuf/*.proto), if missing:
# keel-etcd's client (etcd-client) generates its gRPC code from etcd's
# .proto files at build time, and they import descriptor.proto and
# struct.proto, so every build with all features needs both.
set -euo pipefail

if ! command -v protoc >/dev/null 2>&1 \
  || [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
  "$(dirname "$0")/apt-install.sh" protobuf-compiler libprotobuf-dev
fi
