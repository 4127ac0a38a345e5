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
//! A row the broker refuses for good ([`BrokerError::Invalid`]: a key it
//! cannot carry, a payload over its limit) is **parked** instead of failing
//! the batch: the other rows are published, later rows of its key wait
//! behind it, and an operator replays or discards it (see
//! [`OutboxRelay::run_once`]). Other failures release the claims with each
//! row's attempt counted, and are retried after a backoff.
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
//! 100-500 ms is usually fine, and adds that much latency to every event)
//! or until an [`Outbox`] in this process
//! wakes it after a commit, so in-process events leave at once and events
//! committed by other processes wait at most one interval. A full batch is
//! followed by the next one immediately.
//!
//! With the `failpoints` feature, tests can stop a round dead between its
//! steps (`fail::cfg(name, "1*return")`): `relay-after-claim`,
//! `relay-after-publish` and `relay-after-mark`. The round then returns
//! [`RelayError::Crashed`] without cleaning up, exactly like a dead process.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::trace::{TraceState, span};
use keel_core::{Classify, ErrorClass, TraceParent};
use tokio::sync::Notify;
use tracing::Instrument as _;

use super::Outbox;
use crate::broker::{Broker, BrokerError, header};
use crate::store::{OutboxStore, PendingOutbox, StoreError};

mod options;

pub use options::*;

/// Publishes committed outbox rows to the broker. See the [module
/// docs](self).
#[derive(Debug)]
pub struct OutboxRelay<S, B: ?Sized> {
    store: S,
    broker: Arc<B>,
    wake: Arc<Notify>,
    options: RelayOptions,
    #[cfg(feature = "fence")]
    prune_gate: Option<crate::lease::LeaseGate>,
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
            #[cfg(feature = "fence")]
            prune_gate: None,
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
            let wait = match self.round().await {
                Ok(round) if round.claimed == self.options.batch_size.get() => {
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
    /// nothing to do). A row the broker refuses for good is parked and the
    /// rest of the batch is still published (see *Parking*); on any other
    /// broker failure the claims are released, each row's
    /// attempt counted, so the batch is retried by whichever relay claims
    /// it next.
    ///
    /// # Parking
    ///
    /// A row the broker can never accept ([`BrokerError::Invalid`], from
    /// [`Broker::validate`] before publishing or from the publish itself)
    /// would otherwise be reclaimed and refused forever, and everything
    /// behind it with it. It is parked instead, with its error: it is not
    /// published, later rows of its partition key wait behind it (so none
    /// overtakes it), and other keys flow on. A batch the broker refused as
    /// a whole is republished row by row to find the refused row. Only
    /// `Invalid` parks: every other failure (unreachable, outcome unknown,
    /// an unexpected error) may pass, so it is retried, with the row's
    /// attempts counted.
    pub async fn run_once(&self) -> Result<usize, RelayError> {
        self.round().await.map(|round| round.published)
    }

    async fn round(&self) -> Result<Round, RelayError> {
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
        let round = Round {
            claimed: rows.len(),
            ..Round::default()
        };
        if rows.is_empty() {
            return Ok(round);
        }
        // Publish in id order whatever order the store returned them in.
        rows.sort_unstable_by_key(|r| r.id);
        let span = self.batch_span(&rows);
        self.publish(rows, round, started).instrument(span).await
    }

    /// The batch's span: a new trace linked to each row's producer span
    /// (one send of many messages, as the messaging conventions model it).
    fn batch_span(&self, rows: &[PendingOutbox]) -> tracing::Span {
        let span = tracing::info_span!(
            "outbox.relay",
            otel.name = %format_args!("send {}", self.options.name),
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            "messaging.system" = "keel",
            "messaging.operation.type" = "send",
            "messaging.batch.message_count" = i64::try_from(rows.len()).unwrap_or(i64::MAX),
            "keel.relay.published" = tracing::field::Empty,
        );
        for row in rows {
            let headers = &row.record.headers;
            let Some(producer) = headers
                .get(header::TRACEPARENT)
                .and_then(|t| t.parse::<TraceParent>().ok())
            else {
                continue;
            };
            let state = TraceState::from_raw([headers.get(header::TRACESTATE).map(String::as_str)]);
            span::link(&span, &producer, state.as_ref());
        }
        span::child(&span, None, None);
        span
    }

    /// Publishes the claimed `rows` and marks them (see [`run_once`](Self::run_once)).
    async fn publish(
        &self,
        rows: Vec<PendingOutbox>,
        mut round: Round,
        started: Instant,
    ) -> Result<Round, RelayError> {
        let mut batch = Batch::default();
        for row in rows {
            if batch.is_blocked(&row) {
                batch.held.push(row.id);
                continue;
            }
            let message = row.record.to_message();
            match self.broker.validate(&message) {
                Ok(()) => batch.send.push((row, message)),
                Err(refusal) => {
                    self.park(&row, &refusal).await?;
                    batch.block(&row);
                    round.parked += 1;
                }
            }
        }
        let messages: Vec<_> = batch.send.iter().map(|(_, m)| m.clone()).collect();
        let outcome = if messages.is_empty() {
            Ok(())
        } else {
            self.broker.publish(&messages).await
        };
        let published = match outcome {
            Ok(()) => batch.send.drain(..).map(|(row, _)| row).collect(),
            Err(BrokerError::Invalid(reason)) => {
                tracing::info!(relay = %self.options.name, %reason, rows = messages.len(),
                    "the broker refused a row of the batch; publishing it row by row");
                self.one_by_one(&mut batch, &mut round).await?
            }
            Err(err) => {
                tracing::Span::current().record("otel.status_code", "ERROR");
                let ids: Vec<i64> = batch.send.iter().map(|(row, _)| row.id).collect();
                self.release_failed(&ids, &err).await;
                self.release(&batch.held).await;
                return Err(err.into());
            }
        };
        fail::fail_point!("relay-after-publish", |_| Err(RelayError::Crashed(
            "relay-after-publish"
        )));
        let ids: Vec<i64> = published.iter().map(|r| r.id).collect();
        self.store.outbox_mark_published(&ids).await?;
        fail::fail_point!("relay-after-mark", |_| Err(RelayError::Crashed(
            "relay-after-mark"
        )));
        self.release(&batch.held).await;
        round.published = published.len();
        tracing::Span::current().record(
            "keel.relay.published",
            i64::try_from(published.len()).unwrap_or(i64::MAX),
        );
        record_published(&published, started);
        tracing::debug!(relay = %self.options.name, rows = published.len(),
            parked = round.parked, first_id = ids.first(), last_id = ids.last(),
            "outbox batch published");
        if let Some(err) = batch.failed {
            return Err(err.into());
        }
        Ok(round)
    }

    /// Publishes the batch's rows one at a time after the broker refused
    /// the whole: parks each refused row and holds back the later rows of
    /// its key; stops at the first failure that is not a refusal (leaving
    /// it in `batch.failed`). Returns the rows published.
    async fn one_by_one(
        &self,
        batch: &mut Batch,
        round: &mut Round,
    ) -> Result<Vec<PendingOutbox>, RelayError> {
        let mut published = Vec::new();
        let send = std::mem::take(&mut batch.send);
        let mut rest = send.into_iter();
        for (row, message) in rest.by_ref() {
            if batch.is_blocked(&row) {
                batch.held.push(row.id);
                continue;
            }
            match self.broker.publish(std::slice::from_ref(&message)).await {
                Ok(()) => published.push(row),
                Err(refusal @ BrokerError::Invalid(_)) => {
                    self.park(&row, &refusal).await?;
                    batch.block(&row);
                    round.parked += 1;
                }
                Err(err) => {
                    self.release_failed(&[row.id], &err).await;
                    batch.failed = Some(err);
                    break;
                }
            }
        }
        batch.held.extend(rest.map(|(row, _)| row.id));
        Ok(published)
    }

    async fn park(&self, row: &PendingOutbox, refusal: &BrokerError) -> Result<(), RelayError> {
        let error = refusal.to_string();
        self.store.outbox_park(row.id, &error).await?;
        metrics::counter!("keel_outbox_parked_total", "topic" => row.record.topic.clone())
            .increment(1);
        tracing::error!(relay = %self.options.name, id = row.id,
            event_id = %row.record.event_id, topic = %row.record.topic,
            key = %row.record.partition_key, attempts = row.attempts + 1, %error,
            "the broker refused an outbox row for good; parked it (its key waits behind it) \
             until an operator replays or discards it");
        Ok(())
    }

    async fn release_failed(&self, ids: &[i64], err: &BrokerError) {
        if ids.is_empty() {
            return;
        }
        if let Err(store_err) = self
            .store
            .outbox_release_failed(&self.options.name, ids, &err.to_string())
            .await
        {
            tracing::warn!(relay = %self.options.name, error = %store_err,
                "could not release outbox claims; they are retried when the lease ends");
        }
    }

    async fn release(&self, ids: &[i64]) {
        if ids.is_empty() {
            return;
        }
        if let Err(err) = self.store.outbox_release(&self.options.name, ids).await {
            tracing::warn!(relay = %self.options.name, error = %err,
                "could not release outbox claims; they are retried when the lease ends");
        }
    }

    /// Deletes (or [archives](RelayBuilder::archive)) published rows
    /// older than the retention, one bounded batch per statement until none
    /// is left. Returns how many it removed from the outbox.
    pub async fn prune_once(&self) -> Result<u64, RelayError> {
        #[cfg(feature = "fence")]
        if let Some(gate) = &self.prune_gate
            && !gate.holds().await
        {
            return Ok(0);
        }
        let retention =
            chrono::Duration::from_std(self.options.retention).unwrap_or(chrono::Duration::MAX);
        let before = keel_core::clock::utc_now()
            .checked_sub_signed(retention)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        let batch = self.options.prune_batch.get();
        // Between batches the business transactions get the write lock.
        let total = crate::store::delete_in_batches(batch, || async {
            if self.options.archive {
                self.store.outbox_archive(before, batch).await
            } else {
                self.store.outbox_prune(before, batch).await
            }
        })
        .await?;
        if total > 0 {
            let how = if self.options.archive {
                "archived"
            } else {
                "deleted"
            };
            metrics::counter!("keel_outbox_pruned_total", "how" => how).increment(total);
            tracing::info!(relay = %self.options.name, rows = total, how, "outbox pruned");
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
                metrics::gauge!("keel_outbox_parked").set(stats.parked as f64);
                let lag = stats.oldest_unpublished_age.unwrap_or_default();
                metrics::gauge!("keel_outbox_lag_seconds").set(lag.as_secs_f64());
            }
            Err(err) => tracing::debug!(error = %err, "could not read outbox stats"),
        }
    }
}

/// What a round did.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    claimed: usize,
    published: usize,
    parked: usize,
}

/// A claimed batch on its way out: the rows to send, the rows held back
/// behind a parked (or failed) row of their key, and the failure that
/// ended a row-by-row publish.
#[derive(Default)]
struct Batch {
    send: Vec<(PendingOutbox, crate::broker::Message)>,
    held: Vec<i64>,
    blocked: HashSet<String>,
    failed: Option<BrokerError>,
}

impl Batch {
    fn is_blocked(&self, row: &PendingOutbox) -> bool {
        self.blocked.contains(&row.record.partition_key)
    }

    fn block(&mut self, row: &PendingOutbox) {
        self.blocked.insert(row.record.partition_key.clone());
    }
}

fn record_published(rows: &[PendingOutbox], started: Instant) {
    if rows.is_empty() {
        return;
    }
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
