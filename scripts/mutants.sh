#!/usr/bin/env bash
# Mutation testing (cargo-mutants, installed from crates.io when missing) of
# the modules that hold Keel's promises. Each mutant is a small change to the
# code (a condition negated, a `+` made `-`, a function returning a default);
# the module's tests must fail on it. RELIABILITY.md records each module's
# score and why every surviving mutant is equivalent, or the test that now
# kills it.
#
#   scripts/mutants.sh MODULE [CARGO-MUTANTS ARGS...]
#
# MODULE: breaker | budget | retry | saga | consumer | idempotency. MUTANTS_JOBS
# (default 1) builds that many mutants at once.
# Tests run under nextest, one process per test, as in CI: tests that read
# the process-wide metrics recorder cannot see each other's counts.
# Results go to target/mutants/MODULE/mutants.out (missed.txt lists the
# survivors); the last line printed is the score.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants

module="${1:?usage: $0 breaker|budget|retry|saga|consumer|idempotency [ARGS...]}"
shift
files=()
case "$module" in
  breaker)
    pkg=keel-policy features=full
    files=(crates/keel-policy/src/breaker/{machine,window,state,permit,classify}.rs)
    tests=(--lib --test breaker --test breaker_model) ;;
  budget)
    pkg=keel-policy features=full
    files=(crates/keel-policy/src/retry/budget.rs)
    tests=(--lib --test retry --test retry_budget_model) ;;
  retry)
    pkg=keel-policy features=full
    files=(crates/keel-policy/src/retry/{attempts,backoff,jitter,policy,future}.rs)
    tests=(--lib --test retry) ;;
  saga)
    pkg=keel-messaging features=""
    files=(crates/keel-messaging/src/saga/machine.rs crates/keel-messaging/src/saga/machine/{deadline,operator}.rs)
    # The machine's own tests. (keel-sqlite's saga model drives it too, but
    # cargo-mutants 27 tests only the mutated package: --test-package is
    # accepted and ignored.)
    tests=(--lib) ;;
  consumer)
    pkg=keel-messaging features=""
    files=(crates/keel-messaging/src/consumer/{process,handler,runtime}.rs)
    tests=(--lib) ;;
  idempotency)
    pkg=keel-http features=idempotency
    files=(crates/keel-http/src/idempotency/{service,settle,lease,key,fingerprint}.rs)
    tests=(--lib --test idempotency) ;;
  *) echo "unknown module: $module" >&2; exit 2 ;;
esac

args=()
for f in "${files[@]}"; do args+=(--file "$f"); done
for t in "${tests[@]}"; do args+=("--cargo-test-arg=$t"); done
[ -n "$features" ] && args+=(--features "$features")
out="target/mutants/$module"
mkdir -p "$out"
cargo mutants --package "$pkg" "${args[@]}" --profile mutants --jobs "${MUTANTS_JOBS:-1}" --test-tool nextest \
  --output "$out" "$@" || true
dir="$out/mutants.out"
count() { if [ -s "$dir/$1.txt" ]; then grep -c . "$dir/$1.txt"; else echo 0; fi; }
caught=$(count caught) missed=$(count missed) timeout=$(count timeout) unviable=$(count unviable)
total=$((caught + missed + timeout))
echo "$module: $caught caught, $timeout timed out, $missed missed, $unviable unviable;" \
  "score $(( total ? 100 * (caught + timeout) / total : 0 ))% ($((caught + timeout))/$total)"
