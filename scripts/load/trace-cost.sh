#!/usr/bin/env bash
# What tracing costs `POST /orders`: one release `keel` binary, three modes
# side by side, alternating, two rounds, each on a fresh SQLite database:
#   off   no OTLP endpoint (the default: no tracer, no export thread)
#   on    spans exported over OTLP/HTTP to a receiver on loopback
#   dead  an endpoint nothing listens on (every export fails, spans dropped)
# Prints throughput, latency and keel's CPU time per order (user + system,
# from /proc), and the exported/dropped span counts from /metrics.
#
#   cargo build --release -p keel
#   KEEL=target/release/keel scripts/load/trace-cost.sh
set -u
keel=${KEEL:-target/release/keel}
here=$(dirname "$0")
duration=${DURATION:-10s}
receiver_port=14318
python3 - "$receiver_port" <<'PY' &
import http.server, sys
class Receiver(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver).serve_forever()
PY
receiver=$!
trap 'kill $receiver 2>/dev/null' EXIT
ticks=$(getconf CLK_TCK)
cpu() { awk -v t="$ticks" '{print ($14 + $15) / t}' "/proc/$1/stat"; }
for round in 1 2; do
  for mode in off on dead; do
    dir=$(mktemp -d)
    case $mode in
      off) otlp=() ;;
      on) otlp=(--otlp-endpoint "http://127.0.0.1:$receiver_port") ;;
      dead) otlp=(--otlp-endpoint "http://127.0.0.1:9") ;;
    esac
    KEEL_LOG=warn "$keel" serve --listen 127.0.0.1:18080 --database-url "sqlite:$dir/keel.db" \
      "${otlp[@]}" >/dev/null 2>&1 &
    pid=$!
    sleep 2
    before=$(cpu $pid)
    out=$(wrk -t2 -c32 -d"$duration" --latency -s "$here/orders.lua" http://127.0.0.1:18080)
    after=$(cpu $pid)
    sleep 2
    metrics=$(curl -s http://127.0.0.1:18080/metrics)
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    requests=$(echo "$out" | awk '/requests in/ {print $1}')
    p50=$(echo "$out" | awk '$1=="50%" {print $2}')
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
    cpu_ms=$(awk -v a="$after" -v b="$before" -v n="$requests" 'BEGIN {printf "%.2f", (a - b) * 1000 / n}')
    exported=$(echo "$metrics" | awk '/^keel_otel_spans_exported_total/ {s += $2} END {print s + 0}')
    dropped=$(echo "$metrics" | awk '/^keel_otel_spans_dropped_total/ {s += $2} END {print s + 0}')
    echo "round=$round mode=$mode rps=$rps p50=$p50 p99=$p99 cpu_ms_per_order=$cpu_ms non2xx=${non2xx:-0} spans_exported=$exported spans_dropped=$dropped"
    kill $pid; wait $pid 2>/dev/null; rm -rf "$dir"
  done
done
