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
# KEEL_TEST_RECLAIM_DISK=1 (CI sets it) deletes each phase's build once the
# phase is done: clippy's metadata before the docs, the docs before the
# feature checks, theirs before the test build, the test build before the
# fuzz build. None shares artifacts with the next, and a run that keeps them
# all peaks at about 9.2 GB, which CI machines twice did not have (the fuzz
# build, then the feature checks, ran out of space); reclaiming keeps the
# peak at the test build's 4.7 GB, and the static checks' at about 2 GB
# instead of 3.4, for build scripts run again (a clean run measured 33.5
# minutes against 29). The free space is printed at the start and after
# each phase, so a run that fails for space says how much it had.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*"; }

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

if ! command -v cargo-nextest >/dev/null 2>&1; then
  log "installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

if [ "${KEEL_TEST_QUICK:-0}" != 1 ]; then
  log "cargo fmt --check"
  cargo fmt --all -- --check
  log "cargo clippy --all-targets --all-features -D warnings"
  cargo clippy --workspace --all-targets --all-features -- -D warnings
  reclaim "clippy is done"
  log "cargo doc with warnings as errors (broken intra-doc links)"
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps
  reclaim "the docs are built"
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

log "cargo nextest run (unit, integration and behaviour tests) with PostgreSQL and NATS"
# Build first, so the servers only run while the tests do.
cargo nextest run --workspace --all-features --no-run
scripts/services.sh run cargo nextest run --workspace --all-features --no-fail-fast

log "doc tests"
cargo test --workspace --all-features --doc
reclaim "the tests are done"

log "coverage-guided fuzzing of the network parsers, 15 s per target (scripts/fuzz.sh)"
scripts/fuzz.sh 15
