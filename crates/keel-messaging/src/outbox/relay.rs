//! The relay: moves committed outbox rows to the broker, at least once.
//!
//! One round ([`OutboxRelay::run_once`]) is three durable steps:
//!
//! 1. **claim** up to a batch of unpublished rows, lowest id first, with a
//!    lease, so another relay skips them;
//! 2. **publish** them to the broker in that order, with the event id as
//!    the message id, the subject as the key and the trace context;
//! 3. **mark** them published.
//!
//! A crash between 2 and 3 republishes the batch when the lease runs out:
//! at-least-once, which is why the event id travels on the message (the
//! broker drops a repeated message id, and consumers dedupe on `event-id`).
//! The relay never keeps a "last published id" cursor: it always asks for
//! rows that are still unpublished, so a transaction that took id 7 but
//! committed after id 8 was published is picked up on the next round instead
//! of being skipped forever.
//!
//! Between rounds the relay sleeps for the poll interval (default 200 ms:
//! seed 000 says 100-500 ms "is usually fine, and adds that much latency to
//! every event") or until an [`Outbox`] in this process
//! wakes it after a commit, so in-process events leave at once and events
//! committed by other processes wait at most one interval. A full batch is
//! followed by the next one immediately.
//!
//! With the `failpoints` feature, tests can stop a round dead between its
//! steps (`fail::cfg(name, "1*return")`): `relay-after-claim`,
//! `relay-after-publish` and `relay-after-mark`. The round then returns
//! [`RelayError::Crashed`] without cleaning up, exactly like a dead process.

use std::collections::BTreeMap;
use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Classify, ErrorClass};
use keel_policy::ConfigError;
use keel_policy::retry::Backoff;
use tokio::sync::Notify;

use super::Outbox;
use crate::broker::{Broker, BrokerError};
use crate::store::{OutboxStore, PendingOutbox, StoreError};

/// The default wait between polls when there is nothing to publish.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// The default most rows per round (seed 000's `limit 100`).
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// The default claim lease: how long other relays leave a claimed batch
/// alone, and so how soon a crashed relay's batch is republished.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default time a published row is kept before pruning (seed 000).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// The default time between prune jobs.
pub const DEFAULT_PRUNE_INTERVAL: Duration = Duration::from_secs(600);
/// The default most rows deleted per prune statement.
pub const DEFAULT_PRUNE_BATCH: usize = 1_000;
/// The default least time between refreshes of the lag gauges.
pub const DEFAULT_STATS_INTERVAL: Duration = Duration::from_secs(1);

/// How a relay behaves. Build with [`OutboxRelay::builder`].
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// This relay's name in claims (default `relay-<uuid>`, new each
    /// start). A stable name (the pod name) lets a restarted relay take its
    /// own claims back at once instead of waiting out the lease; two live
    /// relays must never share one.
    pub name: String,
    /// The most rows published per round (default 100).
    pub batch_size: NonZeroUsize,
    /// The wait between polls when idle (default 200 ms).
    pub poll_interval: Duration,
    /// The claim lease (default 30 s).
    pub lease: Duration,
    /// How long published rows are kept (default 7 days).
    pub retention: Duration,
    /// The time between prune jobs (default 10 min).
    pub prune_interval: Duration,
    /// The most rows deleted per prune statement (default 1000), so a prune
    /// never holds a long write lock.
    pub prune_batch: NonZeroUsize,
    /// The delays between failed rounds (default: 200 ms doubling to 10 s,
    /// full jitter).
    pub backoff: Backoff,
    /// The least time between refreshes of `keel_outbox_lag_seconds` and
    /// `keel_outbox_unpublished` (default 1 s).
    pub stats_interval: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            name: format!("relay-{}", keel_core::id::new_id()),
            batch_size: NonZeroUsize::new(DEFAULT_BATCH_SIZE).unwrap_or(NonZeroUsize::MIN),
            poll_interval: DEFAULT_POLL_INTERVAL,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            prune_interval: DEFAULT_PRUNE_INTERVAL,
            prune_batch: NonZeroUsize::new(DEFAULT_PRUNE_BATCH).unwrap_or(NonZeroUsize::MIN),
            backoff: Backoff::default(),
            stats_interval: DEFAULT_STATS_INTERVAL,
        }
    }
}

impl RelayOptions {
    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("poll_interval", self.poll_interval),
            ("lease", self.lease),
            ("retention", self.retention),
            ("prune_interval", self.prune_interval),
        ];
        for (field, value) in positive {
            if value.is_zero() {
                return Err(ConfigError::new(field, "must be greater than zero"));
            }
        }
        if self.name.is_empty() {
            return Err(ConfigError::new("name", "must not be empty"));
        }
        Ok(())
    }
}

/// Builds an [`OutboxRelay`].
#[derive(Debug)]
pub struct RelayBuilder<S, B: ?Sized> {
    store: S,
    broker: Arc<B>,
    wake: Arc<Notify>,
    options: RelayOptions,
}

impl<S: OutboxStore, B: Broker + ?Sized> RelayBuilder<S, B> {
    /// Replaces all options at once.
    pub fn options(mut self, options: RelayOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets the relay's name in claims.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.options.name = name.into();
        self
    }

    /// Sets the most rows per round.
    pub fn batch_size(mut self, rows: NonZeroUsize) -> Self {
        self.options.batch_size = rows;
        self
    }

    /// Sets the wait between polls when idle.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.options.poll_interval = interval;
        self
    }

    /// Sets the claim lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// Sets how long published rows are kept.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.options.retention = retention;
        self
    }

    /// Sets the time between prune jobs.
    pub fn prune_interval(mut self, interval: Duration) -> Self {
        self.options.prune_interval = interval;
        self
    }

    /// Sets the most rows deleted per prune statement.
    pub fn prune_batch(mut self, rows: NonZeroUsize) -> Self {
        self.options.prune_batch = rows;
        self
    }

    /// Sets the delays between failed rounds.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }

    /// Builds the relay, refusing zero durations and an empty name.
    pub fn build(self) -> Result<OutboxRelay<S, B>, ConfigError> {
        self.options.validate()?;
        Ok(OutboxRelay {
            store: self.store,
            broker: self.broker,
            wake: self.wake,
            options: self.options,
            last_stats: parking_lot::Mutex::new(None),
        })
    }
}

/// Publishes committed outbox rows to the broker. See the [module
/// docs](self).
#[derive(Debug)]
pub struct OutboxRelay<S, B: ?Sized> {
    store: S,
    broker: Arc<B>,
    wake: Arc<Notify>,
    options: RelayOptions,
    last_stats: parking_lot::Mutex<Option<Instant>>,
}

impl<S: OutboxStore, B: Broker + ?Sized> OutboxRelay<S, B> {
    /// A relay for `outbox`'s rows, woken by its commits, publishing to
    /// `broker`.
    pub fn builder(outbox: &Outbox<S>, broker: Arc<B>) -> RelayBuilder<S, B> {
        RelayBuilder {
            store: outbox.store().clone(),
            broker,
            wake: outbox.waker(),
            options: RelayOptions::default(),
        }
    }

    /// The options in effect.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// Runs rounds until `shutdown` completes: publishes whatever is
    /// unpublished, sleeps until woken or the poll interval passes, prunes
    /// on schedule, and backs off after failures. A round in progress when
    /// `shutdown` fires is finished first, so a published batch is marked.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = pin!(shutdown);
        let mut failures: u32 = 0;
        let mut next_prune = clock::now();
        tracing::info!(relay = %self.options.name, "outbox relay started");
        loop {
            let wait = match self.run_once().await {
                Ok(n) if n == self.options.batch_size.get() => {
                    failures = 0;
                    Duration::ZERO
                }
                Ok(_) => {
                    failures = 0;
                    self.options.poll_interval
                }
                Err(err) => {
                    let delay = self.failure_delay(failures);
                    failures = failures.saturating_add(1);
                    tracing::warn!(relay = %self.options.name, error = %err, ?delay,
                        "outbox relay round failed; backing off");
                    metrics::counter!("keel_outbox_relay_failures_total").increment(1);
                    delay
                }
            };
            if clock::now() >= next_prune {
                if let Err(err) = self.prune_once().await {
                    tracing::warn!(relay = %self.options.name, error = %err, "outbox prune failed");
                }
                next_prune = clock::now() + self.options.prune_interval;
            }
            self.refresh_stats().await;
            let woken = failures == 0;
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = self.wake.notified(), if woken => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
        tracing::info!(relay = %self.options.name, "outbox relay stopped");
    }

    fn failure_delay(&self, failures: u32) -> Duration {
        self.options
            .backoff
            .delay(failures)
            .unwrap_or_else(|| self.options.backoff.max_delay())
    }

    /// One round: claims a batch, publishes it in id order, marks it
    /// published. Returns how many rows it published (0 when there was
    /// nothing to do). On a broker failure the claims are released so the
    /// batch is retried at once by whichever relay claims it next.
    pub async fn run_once(&self) -> Result<usize, RelayError> {
        let started = clock::now();
        let mut rows = self
            .store
            .outbox_claim(
                &self.options.name,
                self.options.batch_size.get(),
                self.options.lease,
            )
            .await?;
        fail::fail_point!("relay-after-claim", |_| Err(RelayError::Crashed(
            "relay-after-claim"
        )));
        if rows.is_empty() {
            return Ok(0);
        }
        // Publish in id order whatever order the store returned them in.
        rows.sort_unstable_by_key(|r| r.id);
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let messages: Vec<_> = rows.iter().map(|r| r.record.to_message()).collect();
        if let Err(err) = self.broker.publish(&messages).await {
            self.release(&ids).await;
            return Err(err.into());
        }
        fail::fail_point!("relay-after-publish", |_| Err(RelayError::Crashed(
            "relay-after-publish"
        )));
        self.store.outbox_mark_published(&ids).await?;
        fail::fail_point!("relay-after-mark", |_| Err(RelayError::Crashed(
            "relay-after-mark"
        )));
        record_published(&rows, started);
        tracing::debug!(relay = %self.options.name, rows = rows.len(),
            first_id = ids.first(), last_id = ids.last(), "outbox batch published");
        Ok(rows.len())
    }

    async fn release(&self, ids: &[i64]) {
        if let Err(err) = self.store.outbox_release(ids).await {
            tracing::warn!(relay = %self.options.name, error = %err,
                "could not release outbox claims; they are retried when the lease ends");
        }
    }

    /// Deletes published rows older than the retention, one bounded batch
    /// per statement until none is left. Returns how many it deleted.
    pub async fn prune_once(&self) -> Result<u64, RelayError> {
        let retention =
            chrono::Duration::from_std(self.options.retention).unwrap_or(chrono::Duration::MAX);
        let before = chrono::Utc::now()
            .checked_sub_signed(retention)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        let batch = self.options.prune_batch.get();
        let mut total = 0;
        loop {
            let deleted = self.store.outbox_prune(before, batch).await?;
            total += deleted;
            if deleted < batch as u64 {
                break;
            }
            // Let the business transactions in between the batches.
            tokio::task::yield_now().await;
        }
        if total > 0 {
            metrics::counter!("keel_outbox_pruned_total").increment(total);
            tracing::info!(relay = %self.options.name, rows = total, "outbox pruned");
        }
        Ok(total)
    }

    /// Reads the outbox's unpublished count and oldest age into the
    /// `keel_outbox_unpublished` and `keel_outbox_lag_seconds` gauges, at
    /// most once per stats interval.
    async fn refresh_stats(&self) {
        let now = clock::now();
        {
            let mut last = self.last_stats.lock();
            if last
                .is_some_and(|at| now.saturating_duration_since(at) < self.options.stats_interval)
            {
                return;
            }
            *last = Some(now);
        }
        match self.store.outbox_stats().await {
            Ok(stats) => {
                metrics::gauge!("keel_outbox_unpublished").set(stats.unpublished as f64);
                let lag = stats.oldest_unpublished_age.unwrap_or_default();
                metrics::gauge!("keel_outbox_lag_seconds").set(lag.as_secs_f64());
            }
            Err(err) => tracing::debug!(error = %err, "could not read outbox stats"),
        }
    }
}

fn record_published(rows: &[PendingOutbox], started: Instant) {
    let mut per_topic: BTreeMap<&str, u64> = BTreeMap::new();
    for row in rows {
        *per_topic.entry(row.record.topic.as_str()).or_default() += 1;
    }
    for (topic, n) in per_topic {
        metrics::counter!("keel_outbox_published_total", "topic" => topic.to_owned()).increment(n);
    }
    metrics::histogram!("keel_outbox_relay_batch_seconds").record(
        clock::now()
            .saturating_duration_since(started)
            .as_secs_f64(),
    );
}

/// A relay round failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox could not be read or updated.
    #[error("outbox relay store error: {0}")]
    Store(#[from] StoreError),
    /// The broker refused or failed the publish; the claims were released.
    #[error("outbox relay could not publish: {0}")]
    Broker(#[from] BrokerError),
    /// A failpoint simulated a crash at this step (tests only): nothing
    /// after it ran, exactly as if the process had died there.
    #[error("simulated crash at failpoint `{0}`")]
    Crashed(&'static str),
}

impl Classify for RelayError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(e) => e.class(),
            Self::Broker(e) => e.class(),
            Self::Crashed(_) => ErrorClass::Retryable,
        }
    }
}
