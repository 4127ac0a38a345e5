//! Two `keel serve` processes on one PostgreSQL and one NATS JetStream
//! share the shop's work, and nothing is done twice, also when both
//! servers restart, or crash (immediate shutdown, SIGKILL), mid-run.
//!
//! Each test has a PostgreSQL schema and a NATS stream prefix of its own,
//! so tests running in parallel on one server never see each other. The
//! invariants are judged by the demo's own check (the keel-testkit ledger
//! plus money conservation), reading the shared schema from here.

#![cfg(all(feature = "postgres", feature = "nats"))]

use std::fs::File;
use std::process::Stdio;
use std::time::Duration;

use futures_util::StreamExt;
use hdrhistogram::Histogram;
use keel::demo::report::{self, Invariants};
use keel::demo::workload::{History, Outcome, WorkloadResult, order_for, read_answer};
use keel::metrics_report::Totals;
use keel_postgres::PgStore;
use keel_testkit::services::{self, Service};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Orders per run.
const ORDERS: u64 = 200;

/// Held for the whole test: shared normally, exclusive by a test that
/// restarts the servers. The lock files are the ones the keel-postgres and
/// keel-nats tests use, so a restart here never hits their tests either.
struct ServerLease {
    _files: Vec<File>,
}

impl ServerLease {
    fn take(exclusive: bool) -> Self {
        let Some(dir) = std::env::var_os("KEEL_TEST_SERVICES_DIR") else {
            return Self { _files: Vec::new() };
        };
        let files = ["keel-postgres-tests.lock", "keel-nats-restart.lock"]
            .iter()
            .map(|name| {
                let file = File::options()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(std::path::Path::new(&dir).join(name))
                    .expect("open a test lock file");
                if exclusive {
                    file.lock().expect("exclusive test lock");
                } else {
                    file.lock_shared().expect("shared test lock");
                }
                file
            })
            .collect();
        Self { _files: files }
    }
}

/// The shared backends of one test.
struct Cluster {
    pg_url: String,
    nats_url: String,
    schema: String,
    prefix: String,
}

impl Cluster {
    fn new() -> Option<Self> {
        let pg_url = services::postgres_url()?;
        let nats_url = services::nats_url()?;
        let id = uuid::Uuid::now_v7().simple().to_string();
        Some(Self {
            pg_url,
            nats_url,
            schema: format!("keel_so_{id}"),
            prefix: format!("so_{}", &id[id.len() - 24..]),
        })
    }

    async fn serve(&self, name: &str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--database-url", &self.pg_url])
            .args(["--broker", &self.nats_url])
            .args(["--pg-schema", &self.schema])
            .args(["--stream-prefix", &self.prefix])
            .env("KEEL_LOG", "warn")
            .env_remove("KEEL_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start keel serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.expect("read stdout") {
                if let Some(url) = line.strip_prefix("keel: listening on ") {
                    return url.to_owned();
                }
            }
            panic!("keel serve ({name}) exited before listening");
        })
        .await
        .unwrap_or_else(|_| panic!("keel serve ({name}) did not listen within 60 s"));
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Server {
            _child: child,
            base_url: line,
        }
    }

    async fn store(&self) -> PgStore {
        PgStore::options()
            .schema(self.schema.clone())
            .max_connections(4)
            .open(&self.pg_url)
            .await
            .expect("open the shared schema")
    }
}

/// A running `keel serve`, killed when dropped.
struct Server {
    _child: Child,
    base_url: String,
}

impl Server {
    async fn totals(&self, http: &reqwest::Client) -> Totals {
        let text = http
            .get(format!("{}/metrics", self.base_url))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics body");
        Totals::from_text(&text)
    }
}

/// Submits until accepted or refused, recording every call in `history`
/// as ok, failed or unknown.
async fn submit(http: &reqwest::Client, base_url: &str, key: &str, body: &[u8], history: &History) {
    for attempt in 0..300u64 {
        let sent = http
            .post(format!("{base_url}/orders"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await;
        let outcome = match sent {
            Ok(response) => read_answer(response).await,
            Err(e) => Outcome::Unknown { why: e.to_string() },
        };
        let done = match &outcome {
            Outcome::Ok { .. } => true,
            Outcome::Failed { status } if *status != 409 => {
                panic!("key {key}: refused with {status}")
            }
            Outcome::Failed { .. } | Outcome::Unknown { .. } => false,
        };
        history.record(key, outcome);
        if done {
            return;
        }
        // A duplicate in flight (409), a 5xx or no connection (a server
        // restarting): the same key again, as a client would.
        tokio::time::sleep(Duration::from_millis(40 * (attempt.min(10) + 1))).await;
    }
}

/// Sends `ORDERS` orders, alternating between the servers; every 5th is
/// sent again to the *other* server after its answer, every 10th to both
/// at once. Returns what the clients saw, as the demo's check wants it.
async fn workload(servers: &[&Server], seed: u64) -> WorkloadResult {
    let http = reqwest::Client::new();
    let history = History::default();
    let urls: Vec<String> = servers.iter().map(|s| s.base_url.clone()).collect();
    let mut rng = fastrand::Rng::with_seed(seed);
    let jobs: Vec<(u64, String, Vec<u8>)> = (0..ORDERS)
        .map(|n| {
            let order = order_for(n, &mut rng);
            (
                n,
                format!("so-{seed}-{n}"),
                serde_json::to_vec(&order).unwrap(),
            )
        })
        .collect();
    let duplicates: u64 = futures_util::stream::iter(jobs)
        .map(|(n, key, body)| {
            let (http, history) = (http.clone(), &history);
            let first = urls[(n % 2) as usize].clone();
            let other = urls[((n + 1) % 2) as usize].clone();
            async move {
                let mut duplicates = 0;
                if n % 10 == 9 {
                    tokio::join!(
                        submit(&http, &first, &key, &body, history),
                        submit(&http, &other, &key, &body, history)
                    );
                    duplicates += 1;
                } else {
                    submit(&http, &first, &key, &body, history).await;
                }
                if n % 5 == 4 {
                    submit(&http, &other, &key, &body, history).await;
                    duplicates += 1;
                }
                duplicates
            }
        })
        .buffer_unordered(16)
        .fold(0, |total, d| async move { total + d })
        .await;
    let mut result = history.summarize(Histogram::new(3).unwrap());
    result.duplicates_sent = duplicates;
    eprintln!(
        "client calls: {} ok, {} failed, {} unknown ({} keys with an unknown call)",
        result.calls.ok,
        result.calls.failed,
        result.calls.unknown,
        result.unknown_keys.len()
    );
    result
}

/// Waits until every order settled, then judges the invariants; returns
/// them and the number of dead letters.
async fn verdict(store: &PgStore, result: &WorkloadResult) -> (Invariants, usize) {
    let settled = keel::demo::wait_quiescent(store, Duration::from_secs(120), || {}).await;
    assert!(settled, "not every order settled within 120 s");
    let (audit, dead, money, invariants) = report::check(store, result).await.unwrap();
    let unsettled = report::unsettled_sagas(store, &audit).await.unwrap();
    assert!(
        invariants.ok && unsettled.is_empty(),
        "invariants: {invariants:#?}\nmoney: {money:?}\ndead letters: {dead:?}\n\
         sagas neither completed nor compensated:\n{}\n\
         sagas that ended without all their actions' effects:\n{}",
        unsettled.join("\n"),
        sagas_missing_effects(store).await
    );
    assert_eq!(invariants.lost, 0);
    assert_eq!(invariants.duplicated, 0);
    assert_eq!(invariants.unexpected, 0);
    assert!(money.conserved(), "{money:?}");
    assert_eq!(audit.orders.len() as u64, ORDERS);
    // Every event applied once, or (after repeated failures during an
    // outage) parked as a dead letter for an operator: never both.
    assert_eq!(
        (audit.applied.len() + dead.len()) as u64,
        ORDERS,
        "applied {} + dead {}",
        audit.applied.len(),
        dead.len()
    );
    let captures = audit
        .effects
        .iter()
        .filter(|e| e.step == "capture_payment" && !e.compensation)
        .count();
    assert!(captures > 0 && captures as u64 <= ORDERS);
    (invariants, dead.len())
}

/// A saga's id, step, attempts, version and last error, and its effects.
type SagaRow = (String, i64, i64, i64, Option<String>, Vec<String>);

/// For a failed verdict: every saga that ended completed without all four
/// actions' effects, with its record and the effects that do exist.
async fn sagas_missing_effects(store: &PgStore) -> String {
    let rows: Vec<SagaRow> = sqlx::query_as(
        "SELECT s.id, s.step, s.attempts, s.version, s.last_error,
                COALESCE(array_agg(e.step || CASE WHEN e.compensation THEN ' (undo)' ELSE '' END
                                   || ' key=' || e.idem_key ORDER BY e.seq)
                         FILTER (WHERE e.step IS NOT NULL), '{}')
           FROM keel_sagas s LEFT JOIN shop_effects e ON e.order_id = s.id
          WHERE s.status = 'completed'
          GROUP BY s.id
         HAVING COUNT(*) FILTER (WHERE NOT e.compensation) < 4",
    )
    .fetch_all(store.pool())
    .await
    .unwrap_or_default();
    rows.iter()
        .map(|r| format!("{r:?}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_the_work_and_do_nothing_twice() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    let result = workload(&[&a, &b], 11).await;
    assert!(result.failed.is_empty(), "failed keys: {:?}", result.failed);
    assert!(
        result.conflicting_keys.is_empty(),
        "keys answered with two orders or two fresh answers: {:?}",
        result.conflicting_keys
    );
    assert_eq!(result.accepted.len() as u64, ORDERS);
    assert!(result.duplicates_absorbed >= ORDERS / 5);

    let store = cluster.store().await;
    let (_, dead) = verdict(&store, &result).await;
    assert_eq!(dead, 0);

    // The work was shared: each process's consumer applied some of the
    // orders and its relay published some, and together exactly once each.
    let http = reqwest::Client::new();
    let (ta, tb) = (a.totals(&http).await, b.totals(&http).await);
    let applied = |t: &Totals| t.get("keel_consumer_applied_total");
    let published = |t: &Totals| t.get("keel_outbox_published_total");
    assert!(
        applied(&ta) > 0 && applied(&tb) > 0,
        "applied: a {} b {}",
        applied(&ta),
        applied(&tb)
    );
    assert_eq!(
        applied(&ta) + applied(&tb),
        ORDERS,
        "each order applied once in all"
    );
    assert_eq!(
        published(&ta) + published(&tb),
        ORDERS,
        "each event published once: the two relays never take each other's claims"
    );
    eprintln!(
        "shared: a applied {} published {}, b applied {} published {}",
        applied(&ta),
        published(&ta),
        applied(&tb),
        published(&tb)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_postgres_and_nats_mid_run_loses_and_duplicates_nothing() {
    outage_mid_run(services::restart, "restarting").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_postgres_and_nats_mid_run_loses_and_duplicates_nothing() {
    outage_mid_run(services::crash, "crashing").await;
}

/// Runs the two-server workload while `outage` hits PostgreSQL, then
/// nats-server; every order must settle once, with nothing lost.
async fn outage_mid_run(outage: fn(Service) -> Result<(), services::ServiceError>, what: &str) {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(true);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    let servers = [&a, &b];
    let run = workload(&servers, 12);
    let faults = async {
        for service in [Service::Postgres, Service::Nats] {
            tokio::time::sleep(Duration::from_millis(500)).await;
            tokio::task::spawn_blocking(move || outage(service))
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{what} {service:?}: {e}"));
        }
    };
    let (result, ()) = tokio::join!(run, faults);
    assert!(result.failed.is_empty(), "failed keys: {:?}", result.failed);
    assert!(
        result.conflicting_keys.is_empty(),
        "keys answered with two orders or two fresh answers: {:?}",
        result.conflicting_keys
    );
    assert_eq!(result.accepted.len() as u64, ORDERS);
    let store = cluster.store().await;
    let (invariants, dead) = verdict(&store, &result).await;
    eprintln!(
        "after {what} both servers: {dead} dead letters, 0 lost, 0 duplicated, 0 unexpected, \
         {} recovered",
        invariants.recovered
    );
}

/// A key in flight when its server is killed (`SIGKILL`: nothing completes
/// or releases it) is taken over by a retry on another server within
/// seconds, about one 10 s lock, not after a five-minute one; the order is
/// placed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_when_its_server_is_killed_is_taken_over_within_seconds() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let mut a = cluster.serve("a").await;
    let store = cluster.store().await;
    let body = br#"{"customerId":"killed-1","currency":"USD","items":[{"sku":"tea","qty":1,"unitPriceCents":450}]}"#;

    // Hold the orders table, so the request stops inside its handler with
    // its key recorded in flight.
    let mut held = store.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE shop_orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *held)
        .await
        .expect("lock the orders table");
    let http = reqwest::Client::new();
    let stuck = tokio::spawn({
        let (http, url) = (http.clone(), a.base_url.clone());
        async move {
            http.post(format!("{url}/orders"))
                .header("idempotency-key", "killed-key")
                .header("content-type", "application/json")
                .body(body.to_vec())
                .send()
                .await
        }
    });
    let mut in_flight = false;
    for _ in 0..100 {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM keel_idempotency WHERE idem_key = 'killed-key'")
                .fetch_optional(store.pool())
                .await
                .expect("read the key");
        if state.as_deref() == Some("in_flight") {
            in_flight = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(in_flight, "the request never recorded its key");

    a._child.kill().await.expect("SIGKILL server a");
    let killed = tokio::time::Instant::now();
    assert!(
        stuck.await.expect("task").is_err(),
        "server a died mid-request"
    );
    held.rollback().await.expect("release the table");

    let b = cluster.serve("b").await;
    let mut refused = 0;
    let placed = loop {
        let response = http
            .post(format!("{}/orders", b.base_url))
            .header("idempotency-key", "killed-key")
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await
            .expect("POST /orders to server b");
        match response.status().as_u16() {
            201 => break response.json::<serde_json::Value>().await.expect("order"),
            409 => refused += 1,
            other => panic!("unexpected {other}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "still locked after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let took = killed.elapsed();
    eprintln!("taken over {took:?} after the kill, after {refused} answers of 409");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let orders: i64 =
        sqlx::query_scalar("SELECT count(*) FROM shop_orders WHERE customer_id = 'killed-1'")
            .fetch_one(store.pool())
            .await
            .expect("count orders");
    assert_eq!(orders, 1, "placed once: {placed}");
}

/// The realtime backplane: a customer following its orders over SSE on one
/// server sees every event of an order placed through the other, once
/// each and in order, within seconds (PostgreSQL's notifications wake the
/// other process's stream; nothing polls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_customer_streaming_from_one_server_follows_an_order_placed_on_the_other() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    let http = reqwest::Client::new();
    let mut stream = http
        .get(format!("{}/stream?customerId=backplane", b.base_url))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let placed: serde_json::Value = http
        .post(format!("{}/orders", a.base_url))
        .header("idempotency-key", "backplane-1")
        .json(
            &serde_json::json!({"customerId": "backplane", "currency": "USD",
            "items": [{"sku": "tea", "qty": 2, "unitPriceCents": 450}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let order_id = placed["id"].as_str().unwrap().to_owned();
    let mut text = String::new();
    let mut events = Vec::new();
    let followed = tokio::time::timeout(Duration::from_secs(20), async {
        while !events.iter().any(|e: &String| e == "order.completed") {
            let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
            text.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = text.find("\n\n") {
                let frame: String = text.drain(..end + 2).collect();
                let kind = frame.lines().find_map(|l| l.strip_prefix("event: "));
                let data = frame.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(kind), Some(data)) = (kind, data) {
                    assert!(data.contains(&order_id), "another order's event: {data}");
                    events.push(kind.to_owned());
                }
            }
        }
    })
    .await;
    assert!(followed.is_ok(), "events seen on b within 20 s: {events:?}");
    assert_eq!(
        events,
        ["order.placed", "order.completed"],
        "once each, in order"
    );
}
