//! What the system deletes, and when: every table that client requests
//! grow is pruned by default, so storage under a steady load stays flat.
//!
//! The outbox relay prunes what it published and each consumer its inbox,
//! at the ages and the interval given here. This task prunes the rest, on one process at a time
//! (a lease, as the outbox prune has): expired Idempotency-Keys (each key
//! carries its own expiry), the event log past its age or per-stream count,
//! jobs some time after they expired (until then they answer `410`), and
//! finished webhook deliveries with their attempts. Each delete is a bounded
//! batch, so a prune never holds the write lock for long.

use std::num::NonZeroU64;
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_messaging::lease::LeaseGate;
use keel_realtime::EventLog;
use keel_store::StoreError;
use keel_store::delete_in_batches;
use tokio::sync::watch;

use super::ShopStore;

/// How often the pruners run by default: every 10 minutes.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10 * 60);
/// How long a job is kept after it expired by default: a day (it answers
/// `410 Gone` meanwhile, `404` after).
pub const DEFAULT_JOBS_GRACE: Duration = Duration::from_secs(24 * 3600);
/// How long a finished webhook delivery is kept by default: 7 days.
pub const DEFAULT_WEBHOOK_DELIVERIES: Duration = Duration::from_secs(7 * 24 * 3600);
/// Rows one delete statement removes at most.
const BATCH: usize = 1_000;

/// What the system keeps. The defaults (`Default`) are documented on each
/// field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    /// How often every pruner runs (default [`DEFAULT_INTERVAL`]).
    pub interval: Duration,
    /// Event log: events older than this go (`None`: no age limit;
    /// default 7 days).
    pub event_log_max_age: Option<Duration>,
    /// Event log: the newest this many events per stream stay (`None`: no
    /// count limit; default 10,000).
    pub event_log_keep_last: Option<NonZeroU64>,
    /// Jobs go this long after they expired (default
    /// [`DEFAULT_JOBS_GRACE`]).
    pub jobs_grace: Duration,
    /// Finished webhook deliveries go this long after they last changed
    /// (default [`DEFAULT_WEBHOOK_DELIVERIES`]).
    pub webhook_deliveries: Duration,
    /// Published outbox rows go this long after they were published (the
    /// relay prunes them, on one process at a time; default 7 days).
    pub outbox: Duration,
    /// Inbox rows (what each consumer group processed, for deduplication)
    /// go this long after (each consumer prunes its own; default 7 days):
    /// longer than any redelivery can come.
    pub inbox: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            interval: DEFAULT_INTERVAL,
            event_log_max_age: Some(keel_realtime::DEFAULT_MAX_AGE),
            event_log_keep_last: NonZeroU64::new(keel_realtime::DEFAULT_KEEP_LAST),
            jobs_grace: DEFAULT_JOBS_GRACE,
            webhook_deliveries: DEFAULT_WEBHOOK_DELIVERIES,
            outbox: keel_messaging::outbox::DEFAULT_RETENTION,
            inbox: keel_messaging::consumer::DEFAULT_INBOX_RETENTION,
        }
    }
}

/// Rows one pass of the pruners deleted, per table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Expired Idempotency-Keys.
    pub idempotency_keys: u64,
    /// Event-log events.
    pub events: u64,
    /// Jobs.
    pub jobs: u64,
    /// Finished webhook deliveries.
    pub webhook_deliveries: u64,
}

/// Runs every pruner once, each until a batch comes back short.
pub async fn prune_once<S: ShopStore>(
    store: &S,
    log: &EventLog<S>,
    retention: &Retention,
) -> Result<Pruned, StoreError> {
    let now = keel_core::clock::utc_now();
    let events = keel_realtime::Retention::new()
        .max_age(retention.event_log_max_age)
        .keep_last(retention.event_log_keep_last);
    let pruned = Pruned {
        idempotency_keys: keel_http::idempotency::prune_expired(store, BATCH).await?,
        events: log.trim(&events).await?,
        jobs: delete_in_batches(BATCH, || {
            store.job_prune(ago(now, retention.jobs_grace), BATCH)
        })
        .await?,
        webhook_deliveries: delete_in_batches(BATCH, || {
            store.webhook_prune(ago(now, retention.webhook_deliveries), BATCH)
        })
        .await?,
    };
    for (table, rows) in [
        ("idempotency_keys", pruned.idempotency_keys),
        ("event_log", pruned.events),
        ("jobs", pruned.jobs),
        ("webhook_deliveries", pruned.webhook_deliveries),
    ] {
        metrics::counter!("keel_retention_pruned_total", "table" => table).increment(rows);
    }
    if pruned != Pruned::default() {
        tracing::info!(?pruned, "retention pruned");
    }
    Ok(pruned)
}

/// Runs [`prune_once`] every [`Retention::interval`] while this process
/// holds `gate`'s lease, until `stop` turns `true`; a failed pass is logged
/// and tried again at the next tick.
pub async fn run<S: ShopStore>(
    store: S,
    log: EventLog<S>,
    retention: Retention,
    gate: LeaseGate,
    mut stop: watch::Receiver<bool>,
) {
    let stopped = async move {
        let _ = stop.wait_for(|stopped| *stopped).await;
    };
    keel_core::clock::every(retention.interval, stopped, || async {
        if !gate.holds().await {
            return;
        }
        if let Err(error) = prune_once(&store, &log, &retention).await {
            metrics::counter!("keel_retention_errors_total").increment(1);
            tracing::warn!(%error, "retention pass failed; trying again at the next tick");
        }
    })
    .await;
}

/// `now` minus `age`, or the beginning of time when that underflows.
fn ago(now: DateTime<Utc>, age: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(age)
        .ok()
        .and_then(|age| now.checked_sub_signed(age))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}
