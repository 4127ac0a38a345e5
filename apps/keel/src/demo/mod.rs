//! `keel demo`: the whole system on the embedded defaults (a SQLite file in
//! a temporary directory, the SQLite broker), a workload of orders with
//! duplicates and a flaky payments service, and the invariants' verdict.
//!
//! `keel demo --backend postgres+nats` runs the same on PostgreSQL and NATS
//! JetStream instead, in a schema and under a stream prefix of the run's
//! own (the invariants judge this run's rows only); the schema is dropped
//! afterwards, the streams age out with their retention.

pub mod experiment;
pub mod history;
pub mod progress;
pub mod quotes;
pub mod report;
pub mod shipments;
mod table;
pub mod workload;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_sqlite::store::SqliteSynchronous;
use keel_sqlite::{SqliteBrokerOptions, SqliteStore};
use keel_store::broker::Broker;
use keel_webhooks::NewEndpoint;
use tokio::sync::watch;

use crate::backend::{self, Backend, BackendOptions, OnStore, OpenedStore};
use crate::shop::model::OrderStatus;
use crate::shop::services::PaymentsFaults;
use crate::shop::{ShopStore, System, SystemConfig, SystemHandle};
use progress::ProgressLine;
use report::Report;
use workload::{Progress, WorkloadConfig};

/// How the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoConfig {
    /// The workload.
    pub workload: WorkloadConfig,
    /// The longest wait for every order to settle after the workload.
    pub settle_timeout: Duration,
    /// Whether to draw the progress line on stderr.
    pub progress: bool,
    /// `None`: the embedded defaults in a temporary directory. Otherwise
    /// these backends; the schema and stream prefix are replaced by ones
    /// of the run's own.
    pub backend: Option<BackendOptions>,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            workload: WorkloadConfig::default(),
            settle_timeout: Duration::from_secs(60),
            progress: true,
            backend: None,
        }
    }
}

/// Opens the embedded defaults in `dir`: the store and the broker, each in
/// its own SQLite file. `synchronous = NORMAL`: the files are thrown away
/// after the demo, so surviving power loss buys nothing here.
pub async fn open_embedded(
    dir: &std::path::Path,
) -> anyhow::Result<(SqliteStore, Arc<dyn Broker>)> {
    let store = SqliteStore::options()
        .synchronous(SqliteSynchronous::Normal)
        .open(dir.join("keel.db"))
        .await?;
    let broker = SqliteBrokerOptions::new()
        .synchronous(SqliteSynchronous::Normal)
        .poll_interval(Duration::from_millis(20))
        .open(dir.join("broker.db"))
        .await?;
    Ok((store, Arc::new(broker)))
}

/// A webhook receiver on loopback that counts deliveries.
async fn webhook_receiver(
    count: Arc<AtomicU64>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move || {
            let count = Arc::clone(&count);
            async move {
                count.fetch_add(1, Ordering::Relaxed);
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    tokio::spawn(async move {
        let mut shutdown = shutdown;
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = shutdown.wait_for(|s| *s).await;
            })
            .await;
    });
    Ok(format!("http://{addr}/hooks"))
}

/// Whether every order settled: the outbox is drained, and every order has
/// left `pending` (or its event is a dead letter).
pub async fn quiescent<S: ShopStore>(store: &S) -> Result<bool, keel_store::StoreError> {
    let outbox = store.outbox_stats().await?;
    if outbox.unpublished > 0 {
        return Ok(false);
    }
    let counts = store.order_counts().await?;
    let pending: u64 = counts
        .iter()
        .filter(|(s, _)| matches!(s, OrderStatus::Pending))
        .map(|(_, n)| n)
        .sum();
    let dead: u64 = store
        .dead_letter_counts()
        .await?
        .iter()
        .map(|(_, n)| n)
        .sum();
    Ok(pending <= dead)
}

/// Waits until [`quiescent`], at most `timeout`; whether it got there.
pub async fn wait_quiescent<S: ShopStore>(
    store: &S,
    timeout: Duration,
    mut tick: impl FnMut(),
) -> bool {
    let until = keel_core::clock::now() + timeout;
    loop {
        tick();
        if matches!(quiescent(store).await, Ok(true)) {
            // One more look after a pause: a webhook delivery queued with
            // the last settled order may still be on its way.
            tokio::time::sleep(Duration::from_millis(100)).await;
            if matches!(quiescent(store).await, Ok(true)) {
                return true;
            }
        }
        if keel_core::clock::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn progress_text(progress: &Progress, total: u64, settled: u64, phase: &str) -> String {
    format!(
        "{phase}: {} answers ({total} orders + duplicates), accepted {}, settled {settled}",
        progress.answered.load(Ordering::Relaxed),
        progress.accepted.load(Ordering::Relaxed),
    )
}

/// Runs the demo on a started system and builds the report.
pub async fn run_on<S: ShopStore>(
    handle: &SystemHandle<S>,
    config: &DemoConfig,
    webhooks_received: Arc<AtomicU64>,
) -> anyhow::Result<Report> {
    let started = keel_core::clock::now();
    let progress = Arc::new(Progress::default());
    let total = config.workload.orders;
    let line = Arc::new(ProgressLine::for_stderr());
    let ticker = config.progress.then(|| {
        let (progress, line) = (Arc::clone(&progress), Arc::clone(&line));
        let settled = Arc::clone(&handle.settled);
        tokio::spawn(async move {
            loop {
                let settled = settled.load(Ordering::Relaxed);
                line.show(progress_text(&progress, total, settled, "sending"));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let result = workload::run(&handle.base_url, &config.workload, Arc::clone(&progress)).await?;
    if let Some(t) = ticker {
        t.abort();
    }
    let settled = Arc::clone(&handle.settled);
    let show = config.progress;
    let quiet = wait_quiescent(&handle.store, config.settle_timeout, || {
        if show {
            let settled = settled.load(Ordering::Relaxed);
            line.show(progress_text(&progress, total, settled, "settling"));
        }
    })
    .await;
    // Give the webhook worker a moment to deliver the last batch.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if show {
        line.finish();
    }
    let mut report =
        report::assemble(&handle.store, &result, total, started.elapsed(), quiet).await?;
    report.webhooks_received = webhooks_received.load(Ordering::Relaxed);
    if let Some(first) = result.accepted.first() {
        let outcome = experiment::run(&handle.base_url, &first.order_id).await?;
        report.experiment = outcome.summary;
        if !outcome.violations.is_empty() {
            report.invariants.ok = false;
            report.invariants.violations.extend(outcome.violations);
        }
    }
    let order_ids: Vec<String> = result.accepted.iter().map(|a| a.order_id.clone()).collect();
    let quotes = quotes::run(&handle.base_url, &order_ids).await?;
    report.shipping_quotes = quotes.summary();
    report.quotes_partial = quotes.partial;
    if !quotes.violations.is_empty() {
        report.invariants.ok = false;
        report.invariants.violations.extend(quotes.violations);
    }
    let shipping_grpc = &handle.dependencies.urls().shipping_grpc;
    let watched = shipments::run(shipping_grpc, &order_ids).await?;
    report.shipment_watch = watched.summary;
    if !watched.violations.is_empty() {
        report.invariants.ok = false;
        report.invariants.violations.extend(watched.violations);
    }
    if !quiet {
        report
            .invariants
            .violations
            .push("not every accepted order settled within the wait".into());
    }
    Ok(report)
}

/// `keel demo`: starts everything in a temporary directory (or on the
/// configured backends), runs the workload, shuts down, and returns the
/// report.
pub async fn run(config: DemoConfig) -> anyhow::Result<Report> {
    crate::metrics_report::install();
    if let Some(options) = config.backend.clone() {
        return run_scale_out(&config, options).await;
    }
    let dir = tempfile::tempdir()?;
    let (store, broker) = open_embedded(dir.path()).await?;
    let place = format!("SQLite in {}", dir.path().display());
    run_system(store, broker, &config, &place).await
}

/// The demo on `options`, in a fresh schema and stream prefix, so that the
/// invariants judge this run alone; drops the schema afterwards.
async fn run_scale_out(config: &DemoConfig, options: BackendOptions) -> anyhow::Result<Report> {
    let id = keel_core::id::new_id().simple().to_string();
    let options = BackendOptions {
        pg_schema: format!("keel_demo_{id}"),
        stream_prefix: format!("demo_{}", &id[id.len() - 24..]),
        ..options
    };
    let place = options.describe();
    let backend = Backend::open(&options).await?;
    let store = backend.store.clone();
    let report = backend.run(Demo { config, place }).await;
    drop_run_schema(&store).await;
    report
}

/// Drops the run's PostgreSQL schema (SQLite's temporary directory goes
/// by itself).
async fn drop_run_schema(store: &OpenedStore) {
    #[cfg(feature = "postgres")]
    if let OpenedStore::Postgres(store) = store {
        let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", store.schema());
        if let Err(err) = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .execute(store.pool())
            .await
        {
            eprintln!("keel demo: could not drop schema {}: {err}", store.schema());
        }
        store.close().await;
    }
    #[cfg(not(feature = "postgres"))]
    let _ = store;
}

/// The demo, on whichever store was opened.
struct Demo<'a> {
    config: &'a DemoConfig,
    place: String,
}

impl OnStore for Demo<'_> {
    type Output = anyhow::Result<Report>;

    async fn run<S: ShopStore>(self, store: S, broker: Arc<dyn Broker>) -> Self::Output {
        run_system(store, broker, self.config, &self.place).await
    }
}

async fn run_system<S: ShopStore>(
    store: S,
    broker: Arc<dyn Broker>,
    config: &DemoConfig,
    place: &str,
) -> anyhow::Result<Report> {
    let (stop_hooks, hooks_stopped) = watch::channel(false);
    let received = Arc::new(AtomicU64::new(0));
    let hook_url = webhook_receiver(Arc::clone(&received), hooks_stopped).await?;
    let system = SystemConfig {
        payments_faults: PaymentsFaults::demo(config.workload.orders),
        allow_loopback_webhooks: true,
        chaos_experiments: true,
        ..SystemConfig::default()
    };
    eprintln!(
        "keel demo: {} orders, {place}, webhook endpoints on loopback allowed for the demo's receiver",
        config.workload.orders,
    );
    let handle = System::start(store, broker, system, |_| Ok(axum::Router::new())).await?;
    let _wakeups = backend::spawn_wakeups(&handle.store, backend::wake_targets(&handle));
    handle
        .endpoints
        .create(
            NewEndpoint::new(hook_url)
                .description("keel demo receiver")
                .event_types(["order.*"]),
        )
        .await?;
    let report = run_on(&handle, config, received).await;
    handle.shutdown().await;
    let _ = stop_hooks.send(true);
    report
}
