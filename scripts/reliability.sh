#!/usr/bin/env bash
# The fault runs RELIABILITY.md records, by hand (CI runs the short ones as
# tests). Each run is judged by Keel's own checker; nothing is retried.
#
#   scripts/reliability.sh chaos FIRST LAST [ORDERS]
#       `keel chaos` on SQLite for every seed FIRST..LAST (default 200
#       orders, 4 crashes each), one line per seed, then the totals.
#   scripts/reliability.sh scale-out-crash FIRST LAST
#       the scale-out crash test (two keel serve processes; PostgreSQL, with
#       fsync on, and nats-server SIGKILLed mid-run, the order and the pauses
#       drawn from the seed) for every seed FIRST..LAST, under
#       scripts/services.sh.
#   scripts/reliability.sh network-faults FIRST LAST
#       the scale-out pair under the seeded network fault schedules of
#       every seed FIRST..LAST (fault proxies between each keel serve and
#       PostgreSQL / nats-server), under scripts/services.sh; one line per
#       seed, then the totals.
#   scripts/reliability.sh chaos-busy-disk ROUNDS [BINARY]
#       the chaos tests of seeds 3, 5 and 13 at once, ROUNDS times, next to
#       a loop of fsynced 300 MB writes (a busy disk, as a parallel build
#       makes it), with warnings logged; BINARY is a chaos test binary to
#       use instead of this commit's (to compare commits).
#   scripts/reliability.sh power-loss FIRST LAST
#       `keel serve` on SQLite under the faultfs shim, for every seed
#       FIRST..LAST: SIGKILL at random moments, inside an fsync and at
#       failpoints (around a batch's COMMIT, between durable steps), a disk
#       that fills and grows again, a power loss (every write not fsynced
#       dropped) after every kill and at the end; one line per seed, then the
#       totals.
#   scripts/reliability.sh cluster FIRST LAST
#       a three-node NATS JetStream cluster with R3 streams, under
#       scripts/services.sh, for every seed FIRST..LAST: each node in a
#       seeded order SIGKILLed and restarted under load, then (a fresh
#       cluster) each node partitioned away (its routes black-holed) and
#       healed; one line per seed and kind, then the totals.
#   scripts/reliability.sh openapi-fuzz FIRST LAST [EXAMPLES]
#       Schemathesis against a fresh `keel serve` for every seed
#       FIRST..LAST (default 100 examples per operation).
set -euo pipefail
cd "$(dirname "$0")/.."

chaos() {
  local first="$1" last="$2" orders="${3:-200}"
  cargo build -q -p keel --features chaos --bin keel
  local runs=0 failed=0 lost=0 dup=0 unexpected=0 stuck=0 recovered=0 unknown=0
  for seed in $(seq "$first" "$last"); do
    local json out="target/chaos-seed-$seed.log"
    target/debug/keel chaos --seed "$seed" --orders "$orders" --crashes 4 --json >"$out" 2>&1 || true
    json="$(tail -n 1 "$out")"
    local line
    line="$(python3 -c '
import json, sys
try:
    r = json.loads(sys.argv[1])
except Exception:
    print("error"); sys.exit()
d = r["demo"]; i = d["invariants"]
print(r["ok"], i["lost"], i["duplicated"], i["unexpected"], d["sagas_stuck"] + d["sagas_other"],
      i["recovered"], i["calls"]["unknown"], r["crashes_fired"], len(r["crashes"]))
' "$json")"
    runs=$((runs + 1))
    if [ "$line" = error ]; then
      failed=$((failed + 1)); echo "seed $seed: no report (the run failed)"; continue
    fi
    read -r ok l d u s rec unk fired crashes <<<"$line"
    # A failed run keeps its whole report (the verdict lists every violation
    # and every saga left unsettled, with its record and last error).
    if [ "$ok" = True ]; then rm -f "$out"; else failed=$((failed + 1)); fi
    lost=$((lost + l)); dup=$((dup + d)); unexpected=$((unexpected + u)); stuck=$((stuck + s))
    recovered=$((recovered + rec)); unknown=$((unknown + unk))
    echo "seed $seed: ok=$ok lost=$l duplicated=$d unexpected=$u stuck=$s recovered=$rec unknown_calls=$unk crashes=$fired/$crashes"
  done
  echo "chaos: $runs runs, $failed failed, lost $lost, duplicated $dup, unexpected $unexpected, stuck $stuck, recovered $recovered, unknown calls $unknown"
}

scale_out_crash() {
  local first="$1" last="$2" passed=0 bin
  bin="$(WITH_KEEL=1 snapshot_test keel scale_out)"
  for i in $(seq "$first" "$last"); do
    local log rc=0
    log="$(mktemp)"
    CI=true KEEL_FAULT_SEEDS="$i" KEEL_TEST_KEEL_BIN="$(dirname "$bin")/keel" \
      scripts/services.sh run "$bin" --nocapture crashing_postgres_and_nats_mid_run \
      >"$log" 2>&1 || rc=$?
    grep -E "client calls|after crashing|panicked" "$log" || true
    if [ "$rc" = 0 ]; then passed=$((passed + 1)); else cp "$log" "target/scale-out-crash-$i.log"; fi
    rm -f "$log"
    echo "seed $i: exit $rc, $passed passed so far"
  done
  echo "scale-out crash: $((last - first + 1)) runs, $passed passed"
}

network_faults() {
  local first="$1" last="$2" rc=0 log
  log="target/network-faults-$first-$last.log"
  cargo nextest run -p keel --all-features --test network_faults --no-run
  KEEL_NETFAULT_SEEDS="$first-$last" scripts/services.sh run cargo nextest run -p keel \
    --all-features --test network_faults --run-ignored only --no-capture soak >"$log" 2>&1 || rc=$?
  grep -E "^seed [0-9]+: |^soak: |panicked" "$log" || true
  echo "network faults: seeds $first..$last, exit $rc (log: $log)"
  return "$rc"
}

chaos_busy_disk() {
  local rounds="$1" bin="${2:-}" runs=0 failed=0
  if [ -z "$bin" ]; then
    bin="$(cargo nextest list -p keel --all-features --test chaos --message-format json 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(next(iter(d["rust-suites"].values()))["binary-path"])')"
  fi
  local stop hog
  stop="$(mktemp -u)"
  hog="target/busy-disk.bin"
  ( while [ ! -e "$stop" ]; do dd if=/dev/zero of="$hog" bs=1M count=300 conv=fsync status=none; done
    rm -f "$hog" ) &
  for round in $(seq 1 "$rounds"); do
    local pids=()
    for seed in 3 5 13; do
      ( cd apps/keel && KEEL_LOG=warn "$bin" --exact "seed_${seed}_loses_duplicates_and_strands_nothing" \
          --nocapture >"../../target/chaos-busy-$seed-$round.log" 2>&1 ) &
      pids+=("$!")
    done
    local i=0
    for seed in 3 5 13; do
      local rc=0 log="target/chaos-busy-$seed-$round.log"
      wait "${pids[$i]}" || rc=$?
      i=$((i + 1)); runs=$((runs + 1))
      local leaks
      leaks="$(grep -c 'nobody owns\|non-zero transaction depth' "$log" || true)"
      if [ "$rc" = 0 ]; then rm -f "$log"; else failed=$((failed + 1)); fi
      echo "round $round seed $seed: exit $rc, leaked-transaction lines $leaks"
    done
  done
  touch "$stop"
  wait
  echo "chaos on a busy disk: $runs runs, $failed failed"
}

openapi_fuzz() {
  local first="$1" last="$2" examples="${3:-100}" runs=0 failed=0 cases=0
  KEEL_TEST_SCHEMATHESIS="$(scripts/schemathesis.sh)"
  export KEEL_TEST_SCHEMATHESIS
  cargo nextest run -p keel --all-features --test openapi_fuzz --no-run
  for seed in $(seq "$first" "$last"); do
    local log rc=0 line
    log="target/openapi-fuzz-seed-$seed.log"
    KEEL_FUZZ_SEED="$seed" KEEL_FUZZ_EXAMPLES="$examples" cargo nextest run -p keel \
      --all-features --test openapi_fuzz --no-capture >"$log" 2>&1 || rc=$?
    line="$(grep -Eo '[0-9]+ generated, [0-9]+ passed' "$log" | tail -n 1 || true)"
    runs=$((runs + 1))
    local generated="${line%% *}"
    cases=$((cases + ${generated:-0}))
    if [ "$rc" = 0 ]; then rm -f "$log"; else failed=$((failed + 1)); fi
    echo "seed $seed: exit $rc, ${line:-no summary}"
  done
  echo "openapi fuzz: $runs runs, $failed failed, $cases requests"
}

# Builds the integration test TEST of PACKAGE (all features) and copies it
# under target/reliability/, with the keel binary when WITH_KEEL is set:
# a long run then tests one build, whatever is built meanwhile. Prints the
# test binary's path.
snapshot_test() {
  local package="$1" test="$2" dir bin
  dir="target/reliability/$test-$(date +%s)"
  mkdir -p "$dir"
  bin="$(cargo test -q -p "$package" --all-features --test "$test" --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["executable"])' | tail -n 1)"
  cp "$bin" "$dir/$test"
  if [ -n "${WITH_KEEL:-}" ]; then cp target/debug/keel "$dir/keel"; fi
  echo "$dir/$test"
}

power_loss() {
  local first="$1" last="$2" runs=0 failed=0
  local kills=0 in_fsync=0 at_failpoint=0 full=0 ok=0 unknown=0 recovered=0 bin
  bin="$(WITH_KEEL=1 snapshot_test keel power_loss)"
  for seed in $(seq "$first" "$last"); do
    local log rc=0 line
    log="target/power-loss-seed-$seed.log"
    KEEL_FAULT_SEEDS="$seed" KEEL_TEST_KEEL_BIN="$(dirname "$bin")/keel" "$bin" --nocapture \
      >"$log" 2>&1 || rc=$?
    line="$(grep -o 'fault run: seed [0-9]* kills [0-9]* kills-in-fsync [0-9]* kills-at-failpoint [0-9]* disk-full [0-9]* ok [0-9]* failed [0-9]* unknown [0-9]* recovered [0-9]*' "$log" | tail -n 1 || true)"
    runs=$((runs + 1))
    if [ "$rc" = 0 ] && [ -n "$line" ]; then
      read -r -a f <<<"${line#fault run: }"
      kills=$((kills + f[3])); in_fsync=$((in_fsync + f[5])); at_failpoint=$((at_failpoint + f[7]))
      full=$((full + f[9])); ok=$((ok + f[11])); unknown=$((unknown + f[15]))
      recovered=$((recovered + f[17]))
      rm -f "$log"
      echo "$line"
    else
      failed=$((failed + 1))
      echo "seed $seed: FAILED (exit $rc), see $log"
    fi
  done
  echo "power loss: $runs runs, $failed failed; $kills kills, $in_fsync kills inside an fsync," \
    "$at_failpoint kills at a failpoint, $full full disks; $ok acknowledged calls, $unknown unknown, $recovered keys recovered"
}

cluster() {
  local first="$1" last="$2" runs=0 failed=0 bin
  bin="$(snapshot_test keel-nats cluster)"
  for seed in $(seq "$first" "$last"); do
    local log rc=0
    log="target/cluster-seed-$seed.log"
    KEEL_FAULT_SEEDS="$seed" CI=true scripts/services.sh run "$bin" --nocapture --test-threads 1 \
      >"$log" 2>&1 || rc=$?
    runs=$((runs + 2))
    if [ "$rc" = 0 ]; then
      grep -o 'fault run: cluster [a-z]* seed [0-9]*: .* retried' "$log" || true
      rm -f "$log"
    else
      failed=$((failed + 1))
      echo "seed $seed: FAILED (exit $rc), see $log"
    fi
  done
  echo "cluster: $runs runs (kills and partitions), $failed seeds failed"
}

case "${1:-}" in
  chaos) shift; chaos "$@" ;;
  scale-out-crash) shift; scale_out_crash "$@" ;;
  network-faults) shift; network_faults "$@" ;;
  chaos-busy-disk) shift; chaos_busy_disk "$@" ;;
  openapi-fuzz) shift; openapi_fuzz "$@" ;;
  power-loss) shift; power_loss "$@" ;;
  cluster) shift; cluster "$@" ;;
  *) echo "usage: $0 chaos FIRST LAST [ORDERS] | scale-out-crash FIRST LAST | network-faults FIRST LAST | chaos-busy-disk ROUNDS [BINARY] | openapi-fuzz FIRST LAST [EXAMPLES] | power-loss FIRST LAST | cluster FIRST LAST" >&2; exit 2 ;;
esac
