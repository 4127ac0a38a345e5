#!/usr/bin/env bash
# The whole test suite, as the README's quick start and CI run it.
#
# It installs and starts everything the tests need on loopback (PostgreSQL and
# nats-server through scripts/services.sh), then runs: formatting, clippy with
# warnings as errors, the docs with broken links as errors, every test of
# every crate with every feature (against SQLite, the embedded broker,
# PostgreSQL and NATS JetStream), the shipped alert rules (promtool) and
# Kubernetes manifests (kubernetes-validate), the doc tests, and a short
# coverage-guided fuzzing run of every network parser (cargo-fuzz, installed
# from crates.io when missing). Set KEEL_TEST_QUICK=1 to
# skip fmt/clippy/doc.
#
# KEEL_TEST_RECLAIM_DISK=1 (CI sets it) deletes a build once nothing after
# it can use it: the static checks' metadata before the test build, the test
# build before the fuzz build. A run that keeps every build peaks at about
# 9.2 GB, which CI machines twice did not have (the fuzz build, then the
# feature checks, ran out of space); reclaiming keeps the peak at the test
# build's (5.7 GB). The static checks keep their metadata from clippy to
# the feature checks: the docs and the feature checks reuse the
# dependencies' metadata clippy built, and their sum (about 3.5 GB) stays
# below the test build's peak, which comes later, when the installed
# servers have taken their share of the disk. The free space is printed at
# the start and after each phase, so a run that fails for space says how
# much it had.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's line says when it started, so a run's log shows where its time went.
log() { printf '\n==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# Deletes the build of the phase that just ended, when asked to (see above).
reclaim() {
  if [ "${KEEL_TEST_RECLAIM_DISK:-0}" = 1 ]; then
    log "reclaiming $(du -sh "${CARGO_TARGET_DIR:-target}" | cut -f1) of build output: $1"
    cargo clean --quiet
  fi
  df -h . | tail -n 1
}

log "free space at the start"
df -h . | tail -n 1

# One clean build: incremental artifacts only cost disk and time here.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# keel-etcd's client generates code from .proto files when it builds.
scripts/protoc.sh

# tansu, the Kafka-protocol test broker, builds from crates.io for about
# 5 minutes on a fresh machine: beside the static checks, not before the
# tests (scripts/services.sh skips the build once it is there).
tansu_log="$(mktemp)"
scripts/services.sh ensure kafka >"$tansu_log" 2>&1 &
tansu_build=$!

if ! command -v cargo-nextest >/dev/null 2>&1; then
  log "installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

if [ "${KEEL_TEST_QUICK:-0}" != 1 ]; then
  log "cargo fmt --check"
  cargo fmt --all -- --check
  log "cargo clippy --all-targets --all-features -D warnings"
  cargo clippy --workspace --all-targets --all-features -- -D warnings
  log "cargo doc with warnings as errors (broken intra-doc links)"
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps
  log "every crate with each feature alone, and no unused dependency"
  scripts/features.sh
  reclaim "the static checks are done"
fi

log "the Prometheus alert rules, checked and unit-tested by promtool"
scripts/alerts.sh

log "the Kubernetes manifests, against the API schemas and the drain timing"
scripts/kubernetes.sh

log "headless Chromium and chromedriver for the console browser tests"
scripts/browser.sh
export KEEL_TEST_CHROMEDRIVER=/usr/bin/chromedriver

log "nginx for the test that runs keel serve behind it"
scripts/nginx.sh
export KEEL_TEST_NGINX=/usr/sbin/nginx

log "schemathesis for the OpenAPI fuzz test"
KEEL_TEST_SCHEMATHESIS="$(scripts/schemathesis.sh)"
export KEEL_TEST_SCHEMATHESIS

log "Python's gRPC (grpcio) for the shipping service's interop test"
KEEL_TEST_GRPC_PYTHON="$(scripts/grpc_python.sh)"
export KEEL_TEST_GRPC_PYTHON

log "confluent-kafka, the foreign Kafka client of keel-kafka's interop test"
KEEL_TEST_KAFKA_PYTHON="$(scripts/kafka_python.sh)"
export KEEL_TEST_KAFKA_PYTHON

log "cargo nextest run (unit, integration and behaviour tests) with PostgreSQL and NATS"
# Build first, so the servers only run while the tests do.
cargo nextest run --workspace --all-features --no-run
if ! wait "$tansu_build"; then
  log "building tansu failed:"; cat "$tansu_log" >&2; exit 1
fi
scripts/services.sh run cargo nextest run --workspace --all-features --no-fail-fast

log "doc tests"
cargo test --workspace --all-features --doc
reclaim "the tests are done"

log "coverage-guided fuzzing of the network parsers, 15 s per target, unoptimised build (scripts/fuzz.sh)"
FUZZ_PROFILE=dev scripts/fuzz.sh 15
