//! The delivery worker: claims due deliveries from the store, sends them
//! signed, records every attempt, retries on a schedule of hours and
//! disables endpoints that stay broken.
//!
//! # One attempt
//!
//! ```text
//! claim (lease) ─ sign with every active secret ─ POST (timeout, redirects re-checked)
//!   2xx ─────────────────────────────── succeeded
//!   410 Gone ────────────────────────── delivery disabled, endpoint disabled + event
//!   anything else (5xx, 4xx, timeout, refused, SSRF guard):
//!     schedule not used up ──────────── pending, next = now + max(delay, Retry-After ≤ bound)
//!     schedule used up ──────────────── failed (endpoint disabled too if configured)
//!   every failure: failing for the whole failure window? ─ endpoint disabled + event
//! ```
//!
//! Outcomes are recorded in batches, one store transaction for all the
//! attempts that finished meanwhile, so the store is not the bottleneck;
//! one reqwest client (one connection pool) serves every endpoint.
//!
//! # Delivery guarantees
//!
//! At least once: a worker that dies mid-attempt loses its lease and
//! another worker sends the delivery again, with the same `webhook-id`, so
//! receivers dedupe on it. A graceful shutdown stops claiming, lets running
//! attempts finish within the drain timeout and records them.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use chrono::{DateTime, Utc};
use keel_store::{
    ClaimedDelivery, DeliveryOutcome, DeliveryStatus, WebhookDeliveryStore, WebhookEndpointStore,
};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::attempt::Limits;
use super::error::WebhookError;
use super::options::{DisableReason, EndpointDisabled, WorkerOptions};

mod send;

use send::attempt_one;

/// How often recording a batch of outcomes is tried before it is given up
/// (the leases then expire and the deliveries are sent again).
const COMPLETE_ATTEMPTS: u32 = 3;

/// Sends queued deliveries. Cheap to clone; clones share the HTTP client.
///
/// ```no_run
/// use keel_webhooks::{DeliveryWorker, WorkerOptions};
/// use keel_sqlite::SqliteStore;
///
/// # async fn run(store: SqliteStore) -> Result<(), keel_webhooks::WebhookError> {
/// let (tx, mut disabled) = tokio::sync::mpsc::unbounded_channel();
/// let worker = DeliveryWorker::new(store, WorkerOptions::new().notify_disabled(tx))?;
/// tokio::spawn(async move {
///     while let Some(event) = disabled.recv().await {
///         // email the endpoint's owner: event.endpoint_id, event.reason
///         # let _ = event;
///     }
/// });
/// let report = worker.run(async { let _ = tokio::signal::ctrl_c().await; }).await;
/// println!("sent {} deliveries", report.succeeded);
/// # Ok(()) }
/// ```
pub struct DeliveryWorker<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for DeliveryWorker<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S> std::fmt::Debug for DeliveryWorker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryWorker")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

struct Inner<S> {
    store: S,
    options: WorkerOptions,
    client: reqwest::Client,
    limits: Limits,
    user_agent: HeaderValue,
    wake: tokio::sync::Notify,
}

/// What one batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Deliveries claimed and attempted.
    pub attempted: usize,
    /// Attempts answered `2xx`.
    pub succeeded: usize,
    /// Attempts that failed and will be retried.
    pub retrying: usize,
    /// Deliveries that failed for good (schedule used up, or unsendable).
    pub failed: usize,
    /// Endpoints disabled by this batch.
    pub disabled: Vec<EndpointDisabled>,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.attempted += other.attempted;
        self.succeeded += other.succeeded;
        self.retrying += other.retrying;
        self.failed += other.failed;
        self.disabled.extend(other.disabled);
    }
}

/// What one finished attempt needs recorded and decided.
struct Finished {
    outcome: DeliveryOutcome,
    endpoint_id: String,
    url: String,
    exhausted: bool,
}

impl<S: WebhookDeliveryStore + WebhookEndpointStore> DeliveryWorker<S> {
    /// A worker sending the deliveries queued in `store`. Refuses invalid
    /// options.
    pub fn new(store: S, options: WorkerOptions) -> Result<Self, WebhookError> {
        options.validate()?;
        let client = options
            .guard
            .client_builder()
            .connect_timeout(options.timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| WebhookError::Config(format!("could not build the HTTP client: {e}")))?;
        let user_agent = HeaderValue::from_str(&options.user_agent).map_err(|_| {
            WebhookError::Config("the user agent is not a valid header value".into())
        })?;
        let limits = Limits {
            timeout: options.timeout,
            max_redirects: options.max_redirects,
            max_response_body: options.max_response_body,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                options,
                client,
                limits,
                user_agent,
                wake: tokio::sync::Notify::new(),
            }),
        })
    }

    /// Makes a running [`run`](Self::run) claim now instead of at its next
    /// poll: call it after committing deliveries (and, across processes,
    /// from a store wake-up such as PostgreSQL's `LISTEN`). A call while the
    /// worker is busy is remembered, so none is lost; polling stays as the
    /// fallback.
    pub fn notify(&self) {
        self.inner.wake.notify_one();
    }

    /// The options.
    pub fn options(&self) -> &WorkerOptions {
        &self.inner.options
    }

    /// Claims the deliveries due now (up to the batch size), attempts them
    /// all concurrently, records the outcomes and returns what happened.
    /// For tests and cron-style use; [`run`](Self::run) is the long-running
    /// form.
    pub async fn run_once(&self) -> Result<BatchReport, WebhookError> {
        let opts = &self.inner.options;
        let claimed = self.claim(opts.batch.min(opts.max_in_flight)).await?;
        let mut tasks = JoinSet::new();
        for delivery in claimed {
            tasks.spawn(attempt_one(Arc::clone(&self.inner), delivery));
        }
        let mut finished = Vec::with_capacity(tasks.len());
        while let Some(done) = tasks.join_next().await {
            if let Ok(done) = done {
                finished.push(done);
            }
        }
        Ok(self.record(finished).await)
    }

    /// Runs until `shutdown` completes: claims due deliveries whenever there
    /// is room, keeps up to `max_in_flight` attempts running, records
    /// outcomes as they finish (in a recorder task, batching whatever
    /// finished meanwhile), then drains (see the module docs).
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> BatchReport {
        let opts = &self.inner.options;
        let mut report = BatchReport::default();
        let mut tasks: JoinSet<Finished> = JoinSet::new();
        // Attempts finished but not yet recorded still hold their leases,
        // so they count against `max_in_flight` like running ones.
        let mut unrecorded = 0usize;
        let (to_record, mut recorded) = self.spawn_recorder();
        let mut claim_now = true;
        let mut draining = false;
        let drain_deadline = tokio::time::sleep(Duration::MAX);
        tokio::pin!(shutdown, drain_deadline);
        // Claims are write transactions on the store: with a little room,
        // wait for more (a quarter batch) rather than claim a few at a time.
        let min_claim = (opts.batch.min(opts.max_in_flight) / 4).max(1);
        tracing::info!(worker = %opts.name, "webhook delivery worker started");
        loop {
            let room = opts
                .max_in_flight
                .saturating_sub(tasks.len() + unrecorded)
                .min(opts.batch);
            let idle = tasks.is_empty() && unrecorded == 0;
            if claim_now && !draining && room > 0 && (room >= min_claim || idle) {
                match self.claim(room).await {
                    Ok(claimed) => {
                        claim_now = claimed.len() == room;
                        for delivery in claimed {
                            tasks.spawn(attempt_one(Arc::clone(&self.inner), delivery));
                        }
                    }
                    Err(err) => {
                        metrics::counter!("keel_webhook_claim_errors_total").increment(1);
                        tracing::warn!(error = %err, "claiming webhook deliveries failed");
                        claim_now = false;
                    }
                }
                metrics::gauge!("keel_webhook_in_flight").set((tasks.len() + unrecorded) as f64);
            }
            if draining && tasks.is_empty() && unrecorded == 0 {
                break;
            }
            tokio::select! {
                biased;
                () = &mut shutdown, if !draining => {
                    draining = true;
                    drain_deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + opts.drain_timeout);
                    tracing::info!(in_flight = tasks.len(), "webhook worker draining");
                }
                () = &mut drain_deadline, if draining => {
                    tracing::warn!(
                        abandoned = tasks.len(),
                        "webhook worker drain timeout: unfinished attempts are retried after their lease"
                    );
                    tasks.abort_all();
                    break;
                }
                Some(done) = recorded.recv(), if unrecorded > 0 => {
                    unrecorded = unrecorded.saturating_sub(done.attempted);
                    report.add(done);
                    claim_now = true;
                }
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    let mut batch = Vec::new();
                    batch.extend(done.ok());
                    while let Some(done) = tasks.try_join_next() {
                        batch.extend(done.ok());
                    }
                    unrecorded += batch.len();
                    if to_record.send(batch).is_err() {
                        tracing::error!("the webhook recorder stopped");
                        break;
                    }
                }
                () = tokio::time::sleep(opts.poll_interval), if !claim_now && !draining => {
                    claim_now = true;
                }
                () = self.inner.wake.notified(), if !claim_now && !draining => {
                    claim_now = true;
                }
            }
        }
        drop(to_record);
        while let Some(done) = recorded.recv().await {
            report.add(done);
        }
        metrics::gauge!("keel_webhook_in_flight").set(0.0);
        tracing::info!(worker = %opts.name, succeeded = report.succeeded, "webhook delivery worker stopped");
        report
    }

    /// A task that records batches of finished attempts one after another,
    /// merging batches that queued up meanwhile into one transaction.
    fn spawn_recorder(
        &self,
    ) -> (
        mpsc::UnboundedSender<Vec<Finished>>,
        mpsc::UnboundedReceiver<BatchReport>,
    ) {
        let (to_record, mut batches) = mpsc::unbounded_channel::<Vec<Finished>>();
        let (reports, recorded) = mpsc::unbounded_channel();
        let worker = self.clone();
        tokio::spawn(async move {
            while let Some(mut batch) = batches.recv().await {
                while let Ok(more) = batches.try_recv() {
                    batch.extend(more);
                }
                let report = worker.record(batch).await;
                if reports.send(report).is_err() {
                    break;
                }
            }
        });
        (to_record, recorded)
    }

    /// Runs the worker on a new task until `shutdown` completes.
    pub fn spawn(
        &self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<BatchReport>
    where
        S: WebhookDeliveryStore + WebhookEndpointStore,
    {
        let worker = self.clone();
        tokio::spawn(async move { worker.run(shutdown).await })
    }

    async fn claim(&self, limit: usize) -> Result<Vec<ClaimedDelivery>, WebhookError> {
        let opts = &self.inner.options;
        Ok(self
            .inner
            .store
            .webhook_claim_due(
                &opts.name,
                opts.clock.now(),
                limit,
                opts.per_endpoint,
                opts.lease_duration(),
            )
            .await?)
    }

    /// Records a batch of outcomes and makes the endpoint decisions.
    async fn record(&self, finished: Vec<Finished>) -> BatchReport {
        let mut report = BatchReport {
            attempted: finished.len(),
            ..BatchReport::default()
        };
        if finished.is_empty() || !self.complete(&finished).await {
            return report;
        }
        let opts = &self.inner.options;
        let Triage {
            mut to_disable,
            failing,
            healthy,
        } = triage(&finished, opts.disable_when_exhausted, &mut report);
        let now = opts.clock.now();
        self.check_failure_windows(failing, &healthy, &mut to_disable, now)
            .await;
        let mut done: HashSet<&str> = HashSet::new();
        for (f, reason) in to_disable {
            if !done.insert(&f.endpoint_id) {
                continue;
            }
            if let Some(event) = self.disable(f, reason, now).await {
                report.disabled.push(event);
            }
        }
        report
    }

    /// Stores the outcomes in one transaction, retrying a few times; false
    /// if they could not be stored (their leases then run out and the
    /// deliveries are sent again, so no endpoint decision is made on them).
    async fn complete(&self, finished: &[Finished]) -> bool {
        let opts = &self.inner.options;
        let outcomes: Vec<DeliveryOutcome> = finished.iter().map(|f| f.outcome.clone()).collect();
        let mut tries = 0;
        loop {
            tries += 1;
            match self
                .inner
                .store
                .webhook_complete(&opts.name, &outcomes)
                .await
            {
                Ok(_) => return true,
                Err(err) if tries < COMPLETE_ATTEMPTS => {
                    tracing::debug!(error = %err, tries, "recording webhook attempts failed, retrying");
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(tries))).await;
                }
                Err(err) => {
                    metrics::counter!("keel_webhook_record_errors_total").increment(1);
                    tracing::error!(
                        error = %err,
                        attempts = outcomes.len(),
                        "could not record webhook attempts; they will be sent again after their leases"
                    );
                    return false;
                }
            }
        }
    }

    /// Adds to `to_disable` the endpoints in `failing` whose failure window
    /// has passed; endpoints that also succeeded in this batch, or are being
    /// disabled already, are not looked up.
    async fn check_failure_windows<'a>(
        &self,
        failing: HashMap<&'a str, &'a Finished>,
        healthy: &HashSet<&'a str>,
        to_disable: &mut Vec<(&'a Finished, DisableReason)>,
        now: DateTime<Utc>,
    ) {
        let opts = &self.inner.options;
        for (endpoint, f) in failing {
            if healthy.contains(endpoint)
                || to_disable.iter().any(|(d, _)| d.endpoint_id == endpoint)
            {
                continue;
            }
            match self.inner.store.webhook_failing_since(endpoint).await {
                Ok(Some(since)) if window_passed(since, now, opts.failure_window) => {
                    to_disable.push((
                        f,
                        DisableReason::FailureWindow {
                            failing_since: since,
                            window: opts.failure_window,
                        },
                    ));
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(error = %err, endpoint, "reading the failure window failed");
                }
            }
        }
    }

    async fn disable(
        &self,
        f: &Finished,
        reason: DisableReason,
        at: DateTime<Utc>,
    ) -> Option<EndpointDisabled> {
        let inner = &self.inner;
        match inner
            .store
            .webhook_endpoint_disable(&f.endpoint_id, &reason.to_string(), at)
            .await
        {
            Ok(true) => {
                let event = EndpointDisabled {
                    endpoint_id: f.endpoint_id.clone(),
                    url: f.url.clone(),
                    reason,
                    at,
                };
                metrics::counter!("keel_webhook_endpoint_disabled_total", "reason" => event.reason.kind())
                    .increment(1);
                tracing::warn!(
                    endpoint = %event.endpoint_id,
                    url = %event.url,
                    reason = %event.reason,
                    "webhook endpoint disabled"
                );
                for callback in &inner.options.on_disabled {
                    callback(&event);
                }
                Some(event)
            }
            Ok(false) => None,
            Err(err) => {
                tracing::warn!(error = %err, endpoint = %f.endpoint_id, "disabling a webhook endpoint failed");
                None
            }
        }
    }
}

/// What a batch's outcomes say about their endpoints.
#[derive(Default)]
struct Triage<'a> {
    /// Endpoints to disable and why, in the order decided (an endpoint may
    /// appear more than once; its first reason is used).
    to_disable: Vec<(&'a Finished, DisableReason)>,
    /// Endpoints with a retrying or failed delivery, each with the first.
    failing: HashMap<&'a str, &'a Finished>,
    /// Endpoints with a successful attempt.
    healthy: HashSet<&'a str>,
}

/// Counts every outcome into `report` and its metrics, warns of deliveries
/// failed for good, and sorts their endpoints by what the outcomes say.
fn triage<'a>(
    finished: &'a [Finished],
    disable_when_exhausted: bool,
    report: &mut BatchReport,
) -> Triage<'a> {
    let mut triage = Triage::default();
    for f in finished {
        count_attempt(&f.outcome);
        match f.outcome.status {
            DeliveryStatus::Succeeded => {
                report.succeeded += 1;
                triage.healthy.insert(&f.endpoint_id);
            }
            DeliveryStatus::Pending => {
                report.retrying += 1;
                triage.failing.entry(&f.endpoint_id).or_insert(f);
            }
            DeliveryStatus::Failed => {
                report.failed += 1;
                tracing::warn!(
                    delivery = f.outcome.attempt.delivery_id,
                    endpoint = %f.endpoint_id,
                    error = ?f.outcome.attempt.error,
                    status = ?f.outcome.attempt.response_status,
                    "webhook delivery failed for good"
                );
                if f.exhausted && disable_when_exhausted {
                    triage.to_disable.push((
                        f,
                        DisableReason::ScheduleExhausted {
                            delivery_id: f.outcome.attempt.delivery_id,
                        },
                    ));
                }
                triage.failing.entry(&f.endpoint_id).or_insert(f);
            }
            DeliveryStatus::Disabled => {
                report.failed += 1;
                triage.to_disable.push((f, DisableReason::Gone));
            }
        }
    }
    triage
}

/// The attempt metrics: one count by outcome, and the latency.
fn count_attempt(outcome: &DeliveryOutcome) {
    let label = match outcome.status {
        DeliveryStatus::Succeeded => "succeeded",
        DeliveryStatus::Pending => "retrying",
        DeliveryStatus::Failed => "failed",
        DeliveryStatus::Disabled => "gone",
    };
    metrics::counter!("keel_webhook_attempts_total", "outcome" => label).increment(1);
    metrics::histogram!("keel_webhook_attempt_duration_seconds")
        .record(outcome.attempt.latency.as_secs_f64());
}

fn window_passed(since: DateTime<Utc>, now: DateTime<Utc>, window: Duration) -> bool {
    chrono::Duration::from_std(window).is_ok_and(|window| now - since >= window)
}
