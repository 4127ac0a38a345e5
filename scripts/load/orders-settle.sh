#!/usr/bin/env bash
# Whether the whole order keeps up: `keel serve` (binary BIN) on a fresh
# SQLite file under `wrk -t2 -c32` for SECS seconds (orders.lua), counting
# the orders taken and the sagas not yet completed or compensated every 10 s,
# the group commit's logical transactions and COMMITs at the end, and the
# same counts 15 s after the load, and the CPU time keel spent and the
# context switches its threads made per order taken (steadier than orders/s
# on a machine that also runs wrk). Needs wrk,
# curl and the sqlite3 CLI.
#
#   cargo build --release -p keel && scripts/load/orders-settle.sh target/release/keel 30
set -u
bin=$1
secs=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
"$bin" serve --listen 127.0.0.1:18080 --database-url "sqlite:$dir/keel.db" >"$dir/log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
sleep 3
load=$(cut -d' ' -f1 /proc/loadavg)
# utime + stime of keel, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
# Context switches of all keel's threads, voluntary or not: each hand-off
# between a tokio worker and an sqlx connection thread costs some.
switches() { cat /proc/"$pid"/task/*/status | awk '/ctxt_switches/ {n += $2} END {print n}'; }
ticks_before=$(cpu_ticks)
switches_before=$(switches)
wrk -t2 -c32 -d"${secs}s" --latency -s "$here/orders.lua" http://127.0.0.1:18080 >"$dir/wrk.txt" &
wrk_pid=$!
count() {
  sqlite3 -readonly "$dir/keel.db" "SELECT (SELECT count(*) FROM shop_orders),
    (SELECT count(*) FROM keel_sagas WHERE status NOT IN ('completed', 'compensated'))" 2>/dev/null
}
for t in $(seq 10 10 "$secs"); do
  sleep 10
  echo "t=${t}s orders|unsettled=$(count)"
done
wait $wrk_pid
ticks_load=$(($(cpu_ticks) - ticks_before))
switches_load=$(($(switches) - switches_before))
sleep 1
end=$(count)
echo "end orders|unsettled=$end"
echo "keel CPU during the load: $((ticks_load * 1000 / $(getconf CLK_TCK))) ms," \
  "$(awk -v t="$ticks_load" -v hz="$(getconf CLK_TCK)" -v o="${end%%|*}" \
    'BEGIN { if (o > 0) printf "%.2f", t * 1000 / hz / o; else printf "n/a" }') ms per order taken"
echo "keel context switches during the load: $switches_load," \
  "$(awk -v s="$switches_load" -v o="${end%%|*}" \
    'BEGIN { if (o > 0) printf "%.1f", s / o; else printf "n/a" }') per order taken"
curl -s http://127.0.0.1:18080/metrics | grep -E '^keel_sqlite_group_commit_size_(sum|count)'
sleep 15
echo "+15s orders|unsettled=$(count)"
echo "load average before: $load"
grep -E "Requests/sec|50%|99%|Non-2xx" "$dir/wrk.txt"
