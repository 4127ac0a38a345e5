#!/usr/bin/env bash
# POST /orders side by side: `keel serve` on the embedded defaults (one or
# more binaries, KEEL_BINS="name=path ...") against the hand-written axum +
# sqlx handler (examples/orders_baseline.rs, BASELINE=path), alternating,
# ROUNDS rounds, each on a fresh SQLite database, `wrk -t2 -c32 -dDURATION`
# with distinct Idempotency-Keys (orders.lua). After each keel run it prints
# the backlog the load left (unpublished outbox rows, sagas by status), then
# again SETTLE seconds later, to show whether the pipeline keeps up.
#
#   cargo build --release -p keel && cargo build --release -p keel-examples --example orders_baseline
#   KEEL_BINS="new=target/release/keel" BASELINE=target/release/examples/orders_baseline \
#     scripts/load/orders-compare.sh
set -u
here=$(dirname "$0")
rounds=${ROUNDS:-2}
duration=${DURATION:-10s}
settle=${SETTLE:-10}
backlog() {
  curl -s http://127.0.0.1:18080/metrics |
    awk '/^keel_outbox_unpublished|^keel_sagas\{/ {printf "%s=%s ", $1, $2}'
}
for round in $(seq "$rounds"); do
  for entry in ${KEEL_BINS:?} "baseline=${BASELINE:?}"; do
    name=${entry%%=*} binary=${entry#*=}
    dir=$(mktemp -d)
    if [ "$name" = baseline ]; then
      "$binary" 127.0.0.1:18080 "$dir/baseline.db" >/dev/null 2>&1 &
    else
      "$binary" serve --listen 127.0.0.1:18080 --database-url "sqlite:$dir/keel.db" >/dev/null 2>&1 &
    fi
    pid=$!
    sleep 3
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$(wrk -t2 -c32 -d"$duration" --latency -s "$here/orders.lua" http://127.0.0.1:18080)
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    p50=$(echo "$out" | awk '$1=="50%" {print $2}')
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
    echo "round=$round bin=$name rps=$rps p50=$p50 p99=$p99 non2xx=${non2xx:-0} load_before=$load"
    if [ "$name" != baseline ]; then
      echo "  backlog at the end: $(backlog)"
      sleep "$settle"
      echo "  backlog ${settle}s later: $(backlog)"
    fi
    kill $pid; wait $pid 2>/dev/null; rm -rf "$dir"
  done
done
