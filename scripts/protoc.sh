#!/usr/bin/env bash
# Installs protoc (Debian's `protobuf-compiler`), if missing: keel-etcd's
# client (etcd-client) generates its gRPC code from etcd's .proto files at
# build time, so every build with all features needs it.
set -euo pipefail

command -v protoc >/dev/null 2>&1 || "$(dirname "$0")/apt-install.sh" protobuf-compiler
