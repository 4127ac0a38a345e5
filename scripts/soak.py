#!/usr/bin/env python3
"""A soak of `keel serve`: steady anonymous load for MINUTES, with the
retention ages shortened so that a few minutes show whether storage and
memory level off.

    scripts/soak.py KEEL_BINARY MINUTES [ORDERS_PER_SECOND]

Load: orders (each under a fresh Idempotency-Key, so each leaves a key,
events and webhook deliveries behind), a report job every second, and a
webhook endpoint on a local receiver so every settled order is delivered.
Every 30 s it prints one line: the process's resident memory, the database
files' size, and the rows of every table that requests grow. The orders
and their sagas are the shop's record and grow by design (and with them
the files); every other table must level off, and so must the memory once
the in-memory caches reach their bounds (the newest 10,000 delivered
shipments, 1,000 reports). Standard library only.
"""

import http.server
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

TABLES = [
    "shop_orders",
    "keel_idempotency",
    "keel_event_log",
    "keel_jobs",
    "keel_webhook_deliveries",
    "keel_webhook_attempts",
    "keel_outbox",
    "keel_inbox",
    "keel_sagas",
]
API_KEY = "soak-key-0123456789abcdef"


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def post(url, body, headers=None):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def start(binary, directory):
    args = [
        binary, "serve", "--listen", "127.0.0.1:0",
        "--database-url", f"sqlite:{directory}/soak.db",
        "--api-key", f"soak:{API_KEY}", "--allow-loopback-webhooks",
        "--idempotency-key-ttl-secs", "60", "--event-log-max-age-secs", "60",
        "--event-log-keep-last", "100", "--job-ttl-secs", "60", "--jobs-grace-secs", "30",
        "--webhook-deliveries-max-age-secs", "60", "--outbox-retention-secs", "60",
        "--inbox-retention-secs", "60", "--retention-interval-secs", "20",
    ]
    env = {**os.environ, "KEEL_LOG": "warn"}
    env.pop("KEEL_CONFIG", None)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(f"{directory}/server.log", "w"),
                               text=True, env=env)
    line = process.stdout.readline()
    assert line.startswith("keel: listening on "), line
    return process, line.split()[-1].strip()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def sample(directory, pid, started, sent):
    db = f"{directory}/soak.db"
    size = sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
    counts = {}
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        for table in TABLES:
            counts[table] = connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        connection.close()
    return {
        "minute": round((time.monotonic() - started) / 60, 1),
        "orders_sent": sent[0],
        "rss_mib": round(rss_kib(pid) / 1024, 1),
        "db_mib": round(size / 2**20, 2),
        **counts,
    }


def load(url, rate, until, sent, statuses):
    interval = 1 / rate
    tick = time.monotonic()
    n = 0
    while time.monotonic() < until:
        key = str(uuid.uuid4())
        order = {"customerId": f"c{n % 50}", "currency": "EUR",
                 "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 100}]}
        status = post(f"{url}/orders", order, {"idempotency-key": key})
        statuses[status] = statuses.get(status, 0) + 1
        sent[0] += 1
        if n % rate == 0:
            post(f"{url}/reports", {"month": "2026-11"}, {"idempotency-key": key})
        n += 1
        tick += interval
        time.sleep(max(0, tick - time.monotonic()))


def main():
    binary, minutes = sys.argv[1], float(sys.argv[2])
    rate = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    directory = tempfile.mkdtemp(prefix="keel-soak.")
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    process, url = start(binary, directory)
    try:
        hook = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
        status = post(f"{url}/webhook-endpoints", {"url": hook}, {"authorization": f"Bearer {API_KEY}"})
        assert status == 201, status
        started = time.monotonic()
        until = started + minutes * 60
        sent, statuses = [0], {}
        worker = threading.Thread(target=load, args=(url, rate, until, sent, statuses), daemon=True)
        worker.start()
        while time.monotonic() < until:
            time.sleep(min(30, max(0, until - time.monotonic())))
            print(json.dumps(sample(directory, process.pid, started, sent)), flush=True)
        worker.join()
        print(json.dumps({"statuses": statuses, "directory": directory}), flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
