#!/usr/bin/env bash
# The whole order on PostgreSQL + NATS, one build after another: for each
# BIN, `keel serve` on a fresh database and stream prefix of the test
# script's servers under `wrk -t2 -c32` for SECS seconds (orders.lua), then
# 10 s to settle; prints the orders taken, the sagas not yet completed or
# compensated, wrk's rate, the committed transactions per order
# (pg_stat_database), and keel's and all PostgreSQL backends' CPU time per
# order (from /proc). List builds alternately (A B A B) to compare them.
# Needs wrk and psql (from the postgresql package).
#
#   scripts/services.sh run scripts/load/orders-pg.sh 20 /tmp/before /tmp/after /tmp/before /tmp/after
set -u
secs=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
hz=$(getconf CLK_TCK)
# utime + stime of the given processes, in clock ticks.
cpu_ticks() {
  local sum=0 pid
  for pid in "$@"; do
    [ -r "/proc/$pid/stat" ] && sum=$((sum + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
  done
  echo "$sum"
}
postgres_ticks() { cpu_ticks $(pgrep -x postgres); }
commits() { psql "$1" -Atc "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"; }

for bin in "$@"; do
  db=orders_$(date +%s%N | tail -c 9)
  psql "$KEEL_TEST_POSTGRES_URL" -qc "CREATE DATABASE $db" >/dev/null
  url="${KEEL_TEST_POSTGRES_URL%/*}/$db"
  dir=$(mktemp -d)
  "$bin" serve --listen 127.0.0.1:18080 --database-url "$url" --broker "$KEEL_TEST_NATS_URL" \
    --stream-prefix "P$db" >"$dir/log" 2>&1 &
  pid=$!
  sleep 4
  load=$(cut -d' ' -f1 /proc/loadavg)
  keel0=$(cpu_ticks $pid) pg0=$(postgres_ticks) tx0=$(commits "$url")
  wrk -t2 -c32 -d"${secs}s" -s "$here/orders.lua" http://127.0.0.1:18080 >"$dir/wrk.txt"
  sleep 10
  keel1=$(cpu_ticks $pid) pg1=$(postgres_ticks) tx1=$(commits "$url")
  orders=$(psql "$url" -Atc "SELECT count(*) FROM shop_orders")
  unsettled=$(psql "$url" -Atc \
    "SELECT count(*) FROM keel_sagas WHERE status NOT IN ('completed', 'compensated')")
  awk -v b="$bin" -v l="$load" -v o="$orders" -v u="$unsettled" -v hz="$hz" \
    -v r="$(awk '/Requests\/sec/ {print $2}' "$dir/wrk.txt")" \
    -v k=$((keel1 - keel0)) -v p=$((pg1 - pg0)) -v t=$((tx1 - tx0)) 'BEGIN {
      o = (o > 0) ? o : 1
      printf "%s load=%s orders=%d unsettled=%d req/s=%s txns/order=%.1f keel=%.2fms/order postgres=%.2fms/order\n",
        b, l, o, u, r, t / o, k * 1000 / hz / o, p * 1000 / hz / o
    }'
  kill $pid
  wait $pid 2>/dev/null
  rm -rf "$dir"
  psql "$KEEL_TEST_POSTGRES_URL" -qc "DROP DATABASE $db" >/dev/null 2>&1
done
