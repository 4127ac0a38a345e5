//! What the scale-out tests share: two or more `keel serve` processes on
//! one PostgreSQL and one NATS JetStream, a workload of orders with
//! duplicates sent to both, and the demo's invariant check as the verdict.
//!
//! Each test has a PostgreSQL schema and a NATS stream prefix of its own,
//! so tests running in parallel on one server never see each other.
#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::process::Stdio;
use std::time::Duration;

use keel::demo::report::{self, Invariants};
use keel::demo::workload::WorkloadResult;
use keel::metrics_report::Totals;
use keel_postgres::PgStore;
use keel_testkit::services::{self, Service};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

#[path = "../history/mod.rs"]
mod history;

pub use history::ORDERS;

/// Held for the whole test: shared normally, exclusive by a test that
/// restarts the servers. The lock files are the ones the keel-postgres and
/// keel-nats tests use, so a restart here never hits their tests either.
pub struct ServerLease {
    _files: Vec<File>,
}

impl ServerLease {
    pub fn take(exclusive: bool) -> Self {
        let Some(dir) = std::env::var_os("KEEL_TEST_SERVICES_DIR") else {
            return Self { _files: Vec::new() };
        };
        let files = [
            "keel-postgres-tests.lock",
            "keel-nats-restart.lock",
            "rabbitmq.lock",
            "kafka.lock",
        ]
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
pub struct Cluster {
    pub pg_url: String,
    pub nats_url: String,
    /// The broker every server uses: NATS unless [`on_rabbitmq`](Self::on_rabbitmq)
    /// or [`on_kafka`](Self::on_kafka).
    pub broker_url: String,
    /// The server behind `broker_url`, for outages.
    pub broker: Service,
    pub schema: String,
    pub prefix: String,
    /// Extra `keel serve` arguments for every server of the cluster.
    pub serve_args: Vec<String>,
    /// How long the servers' setup must stand before a fault may hit it.
    pub settle: Duration,
}

impl Cluster {
    pub fn new() -> Option<Self> {
        let pg_url = services::postgres_url()?;
        let nats_url = services::nats_url()?;
        let id = uuid::Uuid::now_v7().simple().to_string();
        Some(Self {
            pg_url,
            broker_url: nats_url.clone(),
            broker: Service::Nats,
            nats_url,
            schema: format!("keel_so_{id}"),
            prefix: format!("so_{}", &id[id.len() - 24..]),
            serve_args: Vec::new(),
            settle: Duration::ZERO,
        })
    }

    /// The same cluster with its relays streaming the outbox from a
    /// replication slot (`--outbox-relay wal`).
    pub fn on_the_wal(mut self) -> Self {
        self.serve_args
            .extend(["--outbox-relay".to_owned(), "wal".to_owned()]);
        self
    }

    /// The same cluster on RabbitMQ instead of NATS; `None` (skip) without
    /// a RabbitMQ server.
    pub fn on_rabbitmq(mut self) -> Option<Self> {
        self.broker_url = services::rabbitmq_url()?;
        self.broker = Service::RabbitMq;
        // RabbitMQ 3.10 can lose a quorum queue declared within about a
        // second of a SIGKILL (it comes back without a leader; see
        // RELIABILITY.md): a deployment's queues exist long before a crash.
        self.settle = Duration::from_secs(3);
        Some(self)
    }

    /// The same cluster on Kafka (tansu) instead of NATS; `None` (skip)
    /// without a Kafka server.
    pub fn on_kafka(mut self) -> Option<Self> {
        self.broker_url = services::kafka_url()?;
        self.broker = Service::Kafka;
        Some(self)
    }

    /// Drops the WAL relay's slot and publication, once every server of
    /// the cluster is gone (a slot left behind holds WAL for good).
    pub async fn drop_wal_slot(&self) {
        let store = self.store().await;
        let slot = format!("{}_outbox", self.schema);
        for _ in 0..100 {
            // A walsender may outlive its killed client for a while.
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
            )
            .bind(&slot)
            .execute(store.pool())
            .await;
            let dropped = sqlx::query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = $1",
            )
            .bind(&slot)
            .execute(store.pool())
            .await;
            if dropped.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the slot {slot} was never let go of");
    }

    pub async fn serve(&self, name: &str) -> Server {
        self.serve_via(name, &self.pg_url, &self.broker_url).await
    }

    /// A `keel serve` that reaches PostgreSQL and the broker at these URLs
    /// (a fault proxy's, say) rather than the servers' own.
    pub async fn serve_via(&self, name: &str, pg_url: &str, broker_url: &str) -> Server {
        let mut child = Command::new(keel_testkit::services::keel_binary(env!(
            "CARGO_BIN_EXE_keel"
        )))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--database-url", pg_url])
        .args(["--broker", broker_url])
        .args(["--pg-schema", &self.schema])
        .args(["--stream-prefix", &self.prefix])
        .args(&self.serve_args)
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
            child,
            base_url: line,
        }
    }

    pub async fn store(&self) -> PgStore {
        PgStore::options()
            .schema(self.schema.clone())
            .max_connections(4)
            .open(&self.pg_url)
            .await
            .expect("open the shared schema")
    }
}

/// A running `keel serve`, killed when dropped.
pub struct Server {
    /// The process.
    pub child: Child,
    pub base_url: String,
}

impl Server {
    pub async fn totals(&self, http: &reqwest::Client) -> Totals {
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

/// Sends `ORDERS` orders, alternating between the servers: see
/// [`history::workload`].
pub async fn workload(servers: &[&Server], seed: u64) -> WorkloadResult {
    let urls: Vec<String> = servers.iter().map(|s| s.base_url.clone()).collect();
    history::workload(&urls, seed).await
}

/// Waits until every order settled, then judges the invariants; returns
/// them and the number of dead letters.
pub async fn verdict(store: &PgStore, result: &WorkloadResult) -> (Invariants, usize) {
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
pub type SagaRow = (String, i64, i64, i64, Option<String>, Vec<String>);

/// For a failed verdict: every saga that ended completed without all four
/// actions' effects, with its record and the effects that do exist.
pub async fn sagas_missing_effects(store: &PgStore) -> String {
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
