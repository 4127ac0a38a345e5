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
#
# With SEPARATE_DEPENDENCIES=1 the shop's stand-in dependencies get a
# database of their own (--dependencies-database-url), and their
# transactions per order are printed apart from the system's.
#
# With the server started with pg_stat_statements loaded, each run also
# lists the statements per order (the top 25 by calls):
#
#   KEEL_TEST_PG_OPTIONS="-c shared_preload_libraries=pg_stat_statements" \
#     scripts/services.sh run scripts/load/orders-pg.sh 20 BIN
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
  deps_flag=()
  separate=${SEPARATE_DEPENDENCIES:-0}
  if [ "$separate" = 1 ]; then
    psql "$KEEL_TEST_POSTGRES_URL" -qc "CREATE DATABASE ${db}_deps" >/dev/null
    deps_url="${url}_deps"
    deps_flag=(--dependencies-database-url "$deps_url")
  fi
  dir=$(mktemp -d)
  "$bin" serve --listen 127.0.0.1:18080 --database-url "$url" --broker "$KEEL_TEST_NATS_URL" \
    --stream-prefix "P$db" "${deps_flag[@]}" >"$dir/log" 2>&1 &
  pid=$!
  sleep 4
  load=$(cut -d' ' -f1 /proc/loadavg)
  statements=$(psql "$url" -Atc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()" \
    >/dev/null 2>&1 && echo yes)
  keel0=$(cpu_ticks $pid) pg0=$(postgres_ticks) tx0=$(commits "$url") dtx0=0
  [ "$separate" = 1 ] && dtx0=$(commits "$deps_url")
  wrk -t2 -c32 -d"${secs}s" -s "$here/orders.lua" http://127.0.0.1:18080 >"$dir/wrk.txt"
  sleep 10
  keel1=$(cpu_ticks $pid) pg1=$(postgres_ticks) tx1=$(commits "$url") dtx1=0
  [ "$separate" = 1 ] && dtx1=$(commits "$deps_url")
  orders=$(psql "$url" -Atc "SELECT count(*) FROM shop_orders")
  unsettled=$(psql "$url" -Atc \
    "SELECT count(*) FROM keel_sagas WHERE status NOT IN ('completed', 'compensated')")
  awk -v b="$bin" -v l="$load" -v o="$orders" -v u="$unsettled" -v hz="$hz" \
    -v r="$(awk '/Requests\/sec/ {print $2}' "$dir/wrk.txt")" \
    -v k=$((keel1 - keel0)) -v p=$((pg1 - pg0)) -v t=$((tx1 - tx0)) -v d=$((dtx1 - dtx0)) \
    -v sep="$separate" 'BEGIN {
      o = (o > 0) ? o : 1
      deps = (sep == 1) ? sprintf(" (dependencies %.1f)", d / o) : ""
      printf "%s load=%s orders=%d unsettled=%d req/s=%s txns/order=%.1f%s keel=%.2fms/order postgres=%.2fms/order\n",
        b, l, o, u, r, t / o, deps, k * 1000 / hz / o, p * 1000 / hz / o
    }'
  if [ -n "$statements" ]; then
    psql "$url" -Atc "SELECT round(sum(calls)::numeric / $orders, 2) || '  ' || left(regexp_replace(query, '\s+', ' ', 'g'), 110)
      FROM pg_stat_statements JOIN pg_database d ON d.oid = dbid WHERE d.datname = current_database()
      GROUP BY query ORDER BY sum(calls) DESC LIMIT 25"
  fi
  kill $pid
  wait $pid 2>/dev/null
  rm -rf "$dir"
  psql "$KEEL_TEST_POSTGRES_URL" -qc "DROP DATABASE $db" >/dev/null 2>&1
  psql "$KEEL_TEST_POSTGRES_URL" -qc "DROP DATABASE IF EXISTS ${db}_deps" >/dev/null 2>&1
done
