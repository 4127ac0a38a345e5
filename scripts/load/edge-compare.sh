#!/usr/bin/env bash
# Side-by-side: two `keel` binaries (KEEL_OLD, KEEL_NEW), alternating, two
# rounds, each on a fresh SQLite database: /livez, a page of orders, POST
# /orders. Used to compare the edge before (axum::serve) and after Keel's
# own hyper loop with connection limits.
set -u
for round in 1 2; do
  for bin in old new; do
    dir=$(mktemp -d)
    binary=$([ "$bin" = old ] && echo "${KEEL_OLD:?}" || echo "${KEEL_NEW:?}")
    "$binary" serve --listen 127.0.0.1:18080 --database-url sqlite:$dir/keel.db >/dev/null 2>&1 &
    pid=$!
    sleep 2
    for load in livez orders-get orders-post; do
      case $load in
        livez) out=$(wrk -t2 -c32 -d8s --latency http://127.0.0.1:18080/livez) ;;
        orders-get) out=$(wrk -t2 -c32 -d8s --latency 'http://127.0.0.1:18080/orders?limit=20') ;;
        orders-post) out=$(wrk -t2 -c32 -d8s --latency -s "$(dirname "$0")"/orders.lua http://127.0.0.1:18080) ;;
      esac
      rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
      p50=$(echo "$out" | awk '$1=="50%" {print $2}')
      p99=$(echo "$out" | awk '$1=="99%" {print $2}')
      non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
      echo "round=$round bin=$bin load=$load rps=$rps p50=$p50 p99=$p99 non2xx=${non2xx:-0}"
    done
    kill $pid; wait $pid 2>/dev/null; rm -rf $dir
  done
done
