#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of the parsers that face
# the network, and of `keel serve`'s TOML configuration:
# fuzz/fuzz_targets/*.rs, each asserting a property (a round
# trip, a bound), not only "no panic". Seeds are in fuzz/seeds/<target>;
# what a run learns goes to fuzz/corpus/<target> (not committed); a crash
# stops the run with its input in fuzz/artifacts/<target>.
#
#   scripts/fuzz.sh               the test suite's short run: 15 s per target
#   scripts/fuzz.sh 300           5 minutes per target
#   FUZZ_RUNS=10000000 scripts/fuzz.sh   a long run: 10 million executions each
#   scripts/fuzz.sh 60 cloudevents       one target
#
# FUZZ_PROFILE=dev (the test command sets it) builds without optimisation:
# the build takes about half the time (3m26s against 7m16s here) and each
# target runs about 11 times fewer inputs (186k against 2.1M for
# cloudevents in 15 s), enough for the test command's smoke run. Long runs
# keep the default, release.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-15}
shift || true

if ! command -v c++ >/dev/null 2>&1; then
  echo "==> installing g++ (libFuzzer is C++; apt-get)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends g++
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "==> installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
# libFuzzer's instrumentation needs a few unstable compiler flags; the
# stable toolchain accepts them under RUSTC_BOOTSTRAP, so no nightly is
# needed. No sanitizer: Keel has no unsafe code (the workspace denies it),
# and without ASan each target runs several times faster.
export RUSTC_BOOTSTRAP=1
profile=()
if [ "${FUZZ_PROFILE:-release}" = dev ]; then
  profile=(--dev)
fi
cargo fuzz build "${profile[@]}" --sanitizer none --fuzz-dir fuzz

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi
for target in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$target"
  if [ -n "${FUZZ_RUNS:-}" ]; then
    limit=(-runs="$FUZZ_RUNS")
  else
    limit=(-max_total_time="$seconds")
  fi
  echo "==> fuzzing $target (${limit[*]})"
  log="fuzz/corpus/$target.log"
  if ! cargo fuzz run "${profile[@]}" --sanitizer none --fuzz-dir fuzz "$target" \
    "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    "${limit[@]}" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "fuzz target $target failed; its input is in fuzz/artifacts/$target" >&2
    exit 1
  fi
  grep -E '^stat::(number_of_executed_units|new_units_added|peak_rss_mb)' "$log" | sed "s/^/$target /"
done
