//! Bounded retention for the event log: by age, by count per stream, or
//! both, deleted in bounded batches by a background task.
//!
//! The log exists so a client that was away can catch up. Past some age,
//! or some number of events, replaying is worse than starting fresh (the
//! client reloads its view), and an unbounded log only costs disk and
//! slows every read. Each delete is one statement of at most `batch` rows,
//! so a trim never holds the database's write lock for long; a client whose
//! cursor falls behind the retained window is told (`keel.truncated`).

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use keel_store::StoreError;
use keel_store::{EventLogStore, delete_in_batches};
use tokio::sync::watch;

use super::log::EventLog;
use super::wait_drain;

/// How long events are kept by default: 7 days.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// How many events per stream are kept by default.
pub const DEFAULT_KEEP_LAST: u64 = 10_000;
/// The default most rows one delete statement removes.
pub const DEFAULT_TRIM_BATCH: usize = 1_000;
/// How often the retention task trims by default.
pub const DEFAULT_TRIM_INTERVAL: Duration = Duration::from_secs(60);

/// What the event log keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    max_age: Option<Duration>,
    keep_last: Option<NonZeroU64>,
    batch: NonZeroUsize,
    interval: Duration,
}

impl Default for Retention {
    /// 7 days, the newest 10,000 events per stream, batches of 1,000,
    /// every minute.
    fn default() -> Self {
        Self {
            max_age: Some(DEFAULT_MAX_AGE),
            keep_last: NonZeroU64::new(DEFAULT_KEEP_LAST),
            batch: NonZeroUsize::new(DEFAULT_TRIM_BATCH).unwrap_or(NonZeroUsize::MIN),
            interval: DEFAULT_TRIM_INTERVAL,
        }
    }
}

impl Retention {
    /// The defaults (see [`Default`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Deletes events older than this (`None`: no age limit).
    pub fn max_age(mut self, max_age: Option<Duration>) -> Self {
        self.max_age = max_age;
        self
    }

    /// Keeps at most this many newest events per stream (`None`: no count
    /// limit).
    pub fn keep_last(mut self, keep_last: Option<NonZeroU64>) -> Self {
        self.keep_last = keep_last;
        self
    }

    /// The most rows one delete statement removes.
    pub fn batch(mut self, batch: NonZeroUsize) -> Self {
        self.batch = batch;
        self
    }

    /// How often [`EventLog::run_retention`] trims.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
}

impl<S: EventLogStore> EventLog<S> {
    /// Trims once: batch after batch until a batch comes back short;
    /// returns how many events were deleted.
    pub async fn trim(&self, retention: &Retention) -> Result<u64, StoreError> {
        let batch = retention.batch.get();
        let mut deleted = 0;
        if let Some(max_age) = retention.max_age {
            let age = chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX);
            let before = keel_core::clock::utc_now()
                .checked_sub_signed(age)
                .unwrap_or(chrono::DateTime::UNIX_EPOCH);
            let n = delete_in_batches(batch, || self.store().event_log_trim(before, batch)).await?;
            metrics::counter!("keel_event_log_trimmed_total", "rule" => "age").increment(n);
            deleted += n;
        }
        if let Some(keep) = retention.keep_last {
            let n = delete_in_batches(batch, || {
                self.store().event_log_trim_keep_last(keep.get(), batch)
            })
            .await?;
            metrics::counter!("keel_event_log_trimmed_total", "rule" => "count").increment(n);
            deleted += n;
        }
        if deleted > 0 {
            tracing::debug!(deleted, "event log trimmed");
        }
        Ok(deleted)
    }

    /// Trims every [`Retention::interval`] until `drain` turns `true`; a
    /// failed trim is logged and retried at the next tick. Spawn it once per
    /// process (several trimmers are harmless, only wasteful).
    pub async fn run_retention(&self, retention: Retention, mut drain: watch::Receiver<bool>) {
        keel_core::clock::every(retention.interval, wait_drain(&mut drain), || async {
            if let Err(err) = self.trim(&retention).await {
                tracing::warn!(error = %err, "event log trim failed; retrying at the next tick");
                metrics::counter!("keel_event_log_trim_errors_total").increment(1);
            }
        })
        .await;
    }
}
