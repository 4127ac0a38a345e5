//! One delivery, start to finish: the idempotent consumer's state machine
//! (drawn in the [consumer module docs](super)).

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use keel_core::{Deadline, clock};
use tracing::Instrument;

use super::handler::{CommitWork, DeliveryInfo, Disposition, Handler, HandlerError};
use super::options::ConsumerOptions;
use super::trace::{ProducerLink, in_context};
use crate::broker::{BrokerError, Delivery, Message, SubscribeOptions, header};
use crate::dead_letter::{self, kind};
use crate::envelope::{Envelope, EnvelopeError};
use crate::store::{
    AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, InboxStore, Store,
};

/// Deliveries after which each further one logs a warning.
const REPEAT_WARNING: u32 = 3;

/// The most inbox rows deleted per prune statement.
pub(crate) const INBOX_PRUNE_BATCH: usize = 1_000;

/// The store capabilities a consumer needs: the inbox and dead letters.
pub trait ConsumerStore: InboxStore + DeadLetterStore {}

impl<S: InboxStore + DeadLetterStore> ConsumerStore for S {}

/// A (topic, group) and its handlers by event type.
pub(crate) struct Route<Tx> {
    pub(crate) topic: Arc<str>,
    pub(crate) group: Arc<str>,
    pub(crate) handlers: HashMap<String, Arc<dyn Handler<Tx>>>,
    pub(crate) labels: Vec<metrics::Label>,
}

impl<Tx> Route<Tx> {
    pub(crate) fn new(
        topic: Arc<str>,
        group: Arc<str>,
        handlers: HashMap<String, Arc<dyn Handler<Tx>>>,
    ) -> Self {
        let labels = vec![
            metrics::Label::new("topic", Arc::clone(&topic)),
            metrics::Label::new("group", Arc::clone(&group)),
        ];
        Self {
            topic,
            group,
            handlers,
            labels,
        }
    }

    /// What this route subscribes (and declares) its group with: the same
    /// options both times, so a broker never sees the group two ways.
    pub(crate) fn subscribe_options(&self, options: &ConsumerOptions) -> SubscribeOptions {
        SubscribeOptions::new(self.topic.as_ref(), self.group.as_ref()).lease(options.lease)
    }

    fn labels_with(&self, key: &'static str, value: &'static str) -> Vec<metrics::Label> {
        let mut labels = self.labels.clone();
        labels.push(metrics::Label::new(key, value));
        labels
    }
}

/// How a delivery ended, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The handler's effect committed.
    Applied,
    /// The inbox had it already: acked without running the handler.
    Duplicate,
    /// Its deadline had passed: acked without running the handler.
    Expired,
    /// A replay meant for another group: acked without running anything.
    Skipped,
    /// Failed; delivered again after a backoff.
    Retried,
    /// Moved to the dead-letter store.
    DeadLettered(&'static str),
    /// A failpoint simulated a crash: nothing after it ran.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Crashed(&'static str),
}

/// Why an attempt did not commit.
enum Failure {
    Handler(HandlerError),
    Store(crate::store::StoreError),
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Crashed(&'static str),
}

/// A delivery that passed the checks, ready for an attempt.
struct Ready<'r, Tx> {
    envelope: Envelope,
    handler: &'r dyn Handler<Tx>,
    deadline: Option<Deadline>,
    info: DeliveryInfo,
}

/// What an attempt that did not fail did.
enum Step {
    Applied,
    Duplicate,
}

/// Processes deliveries for every route of a consumer.
pub(crate) struct Processor<S> {
    pub(crate) store: S,
    pub(crate) options: ConsumerOptions,
}

impl<S: Store + ConsumerStore> Processor<S> {
    /// Takes one delivery through the state machine and settles it (or,
    /// after a simulated crash, leaves it for redelivery).
    pub(crate) async fn process(&self, route: &Route<S::Tx>, delivery: &Delivery) -> Outcome {
        metrics::counter!("keel_consumer_received_total", route.labels.iter()).increment(1);
        let ready = match self.screen(route, delivery).await {
            Ok(ready) => ready,
            Err(settled) => return settled,
        };
        let msg = &delivery.message;
        let producer = ready
            .envelope
            .trace_parent()
            .or_else(|| msg.header(header::TRACEPARENT)?.parse().ok());
        let context = ProducerLink::new(producer, &ready.envelope, msg, &route.group);
        let span = context.span().clone();
        let attempt = self.attempt(route, ready.handler, &ready.envelope, &ready.info);
        let attempt = keep_lease(delivery, &self.options, attempt);
        let result = in_context(context, ready.deadline, attempt).await;
        self.conclude(route, delivery, &ready.info, result)
            .instrument(span)
            .await
    }

    /// The checks before any work: replays for other groups, deadlines,
    /// decoding, routing, and the delivery limit. `Err` is the outcome of a
    /// delivery settled here.
    async fn screen<'r>(
        &self,
        route: &'r Route<S::Tx>,
        delivery: &Delivery,
    ) -> Result<Ready<'r, S::Tx>, Outcome> {
        let msg = &delivery.message;
        if let Some(target) = msg.header(dead_letter::REPLAY_GROUP_HEADER)
            && target != &*route.group
        {
            self.settle_ack(route, delivery).await;
            return Err(Outcome::Skipped);
        }
        let deadline = read_deadline(msg);
        if deadline.is_some_and(|d| d.is_expired()) {
            tracing::debug!("deadline passed before processing; dropping the message");
            metrics::counter!("keel_consumer_expired_total", route.labels.iter()).increment(1);
            self.settle_ack(route, delivery).await;
            return Err(Outcome::Expired);
        }
        let envelope = match decode(msg) {
            // `time` is when the broker got it (`occurredAt`, in the data,
            // is when the fact happened): the broker's word replaces the
            // producer's guess.
            Ok(env) => with_broker_time(env, delivery),
            Err(err) => {
                let why = format!("cannot decode the CloudEvents envelope: {err}");
                return Err(self
                    .dead_letter(route, delivery, kind::MALFORMED, why)
                    .await);
            }
        };
        let Some(handler) = route.handlers.get(&envelope.ty) else {
            let why = format!(
                "no handler for event type `{}` in group `{}` on topic `{}`",
                envelope.ty, route.group, route.topic
            );
            return Err(self
                .dead_letter(route, delivery, kind::UNKNOWN_TYPE, why)
                .await);
        };
        let max = self.options.max_deliveries.get();
        if delivery.delivery_count > REPEAT_WARNING {
            // Knowing the attempt number lets you alert on the nth
            // try instead of discovering the loop from a DLQ alarm.
            tracing::warn!(
                attempt = delivery.delivery_count,
                "message retried repeatedly"
            );
        }
        if delivery.delivery_count > max {
            let why = format!(
                "delivered {} times, over the limit of {max}; the last attempts ended without \
                 an outcome (the process stopped or the lease was lost mid-handler)",
                delivery.delivery_count
            );
            return Err(self
                .dead_letter(route, delivery, kind::TOO_MANY_ATTEMPTS, why)
                .await);
        }
        let info = DeliveryInfo {
            message: msg.clone(),
            delivery_count: delivery.delivery_count,
            event_id: event_id(msg, &envelope),
            group: route.group.to_string(),
            committed: CommitWork::default(),
        };
        Ok(Ready {
            envelope,
            handler: handler.as_ref(),
            deadline,
            info,
        })
    }

    /// Settles a delivery after an attempt: ack LAST after a commit (or a
    /// duplicate), otherwise retry or dead-letter.
    async fn conclude(
        &self,
        route: &Route<S::Tx>,
        delivery: &Delivery,
        info: &DeliveryInfo,
        result: Result<Step, Failure>,
    ) -> Outcome {
        match result {
            Ok(Step::Applied) => {
                metrics::counter!("keel_consumer_applied_total", route.labels.iter()).increment(1);
                self.settle_ack(route, delivery).await;
                fail::fail_point!("consumer-after-ack", |_| Outcome::Crashed(
                    "consumer-after-ack"
                ));
                if delivery.delivery_count > 1 {
                    self.forget_failures(route, &delivery.message).await;
                }
                Outcome::Applied
            }
            Ok(Step::Duplicate) => {
                tracing::info!(event_id = %info.event_id, "duplicate ignored");
                metrics::counter!("keel_consumer_duplicates_total", route.labels.iter())
                    .increment(1);
                self.settle_ack(route, delivery).await;
                Outcome::Duplicate
            }
            Err(Failure::Crashed(at)) => Outcome::Crashed(at),
            Err(Failure::Store(err)) => {
                // Infrastructure, not the message's fault: always retried.
                let why = format!("store error: {}", keel_core::error::report(&err));
                self.failed(
                    route,
                    delivery,
                    why,
                    Disposition::Retry { after: None },
                    None,
                )
                .await
            }
            Err(Failure::Handler(err)) if err.is_malformed() => {
                self.dead_letter(route, delivery, kind::MALFORMED, err.report())
                    .await
            }
            Err(Failure::Handler(err)) => {
                self.failed(route, delivery, err.report(), err.disposition(), err.kind())
                    .await
            }
        }
    }

    /// Begin, inbox row, handler, commit: the dedupe row and the effect
    /// commit together or not at all.
    async fn attempt(
        &self,
        route: &Route<S::Tx>,
        handler: &dyn Handler<S::Tx>,
        envelope: &Envelope,
        info: &DeliveryInfo,
    ) -> Result<Step, Failure> {
        let mut tx = self.store.begin().await.map_err(Failure::Store)?;
        let fresh = self
            .store
            .inbox_record(&mut tx, &info.event_id, &route.group)
            .await
            .map_err(Failure::Store)?;
        fail::fail_point!("consumer-after-inbox", |_| Err(Failure::Crashed(
            "consumer-after-inbox"
        )));
        if !fresh {
            // The ack waits for the rollback: until it answers, the inbox
            // row that made this a duplicate may not be durable.
            self.store.rollback(tx).await.map_err(Failure::Store)?;
            return Ok(Step::Duplicate);
        }
        let started = clock::now();
        let result = handler.handle(&mut tx, envelope, info).await;
        metrics::histogram!("keel_consumer_handler_seconds", route.labels.iter()).record(
            clock::now()
                .saturating_duration_since(started)
                .as_secs_f64(),
        );
        if let Err(err) = result {
            info.committed.discard();
            self.rollback(tx).await;
            return Err(Failure::Handler(err));
        }
        fail::fail_point!("consumer-after-handler", |_| Err(Failure::Crashed(
            "consumer-after-handler"
        )));
        if let Err(err) = self.store.commit(tx).await {
            info.committed.discard();
            return Err(Failure::Store(err));
        }
        info.committed.run();
        fail::fail_point!("consumer-after-commit", |_| Err(Failure::Crashed(
            "consumer-after-commit"
        )));
        Ok(Step::Applied)
    }

    async fn rollback(&self, tx: S::Tx) {
        if let Err(err) = self.store.rollback(tx).await {
            tracing::debug!(error = %err, "rollback failed; the transaction is discarded anyway");
        }
    }

    /// Records a failed attempt, then retries or dead-letters (under the
    /// handler's own `kind`, if it gave one).
    pub(crate) async fn failed(
        &self,
        route: &Route<S::Tx>,
        delivery: &Delivery,
        why: String,
        disposition: Disposition,
        own_kind: Option<&'static str>,
    ) -> Outcome {
        let count = delivery.delivery_count;
        let attempt = AttemptError {
            attempt: count,
            error: why,
            at: keel_core::clock::utc_now(),
        };
        if let Err(err) = self
            .store
            .failure_record(&route.group, &delivery.message.id, &attempt)
            .await
        {
            tracing::warn!(error = %err, "could not record the failed attempt");
        }
        let max = self.options.max_deliveries.get();
        match disposition {
            Disposition::Permanent => {
                let kind = own_kind.unwrap_or(kind::PERMANENT);
                self.bury(route, delivery, kind, attempt).await
            }
            Disposition::Retry { .. } if count >= max => {
                let kind = own_kind.unwrap_or(kind::TOO_MANY_ATTEMPTS);
                self.bury(route, delivery, kind, attempt).await
            }
            Disposition::Retry { after } => {
                let delay = self.redelivery_delay(count).max(after.unwrap_or_default());
                tracing::info!(attempt = count, error = %attempt.error, ?delay,
                    "handler failed; the message will be delivered again");
                metrics::counter!("keel_consumer_retries_total", route.labels.iter()).increment(1);
                self.settle_nack(route, delivery, delay).await;
                Outcome::Retried
            }
        }
    }

    fn redelivery_delay(&self, delivery_count: u32) -> Duration {
        let backoff = &self.options.backoff;
        backoff
            .delay(delivery_count.saturating_sub(1))
            .unwrap_or_else(|| backoff.max_delay())
    }

    /// Dead-letters at once, with whatever history there is plus `why`.
    async fn dead_letter(
        &self,
        route: &Route<S::Tx>,
        delivery: &Delivery,
        kind: &'static str,
        why: String,
    ) -> Outcome {
        let attempt = AttemptError {
            attempt: delivery.delivery_count,
            error: why,
            at: keel_core::clock::utc_now(),
        };
        self.bury(route, delivery, kind, attempt).await
    }

    /// Puts the message in the dead-letter store with its whole history,
    /// then terminates the delivery. If the store refuses, the message is
    /// nacked instead: a dead letter is never dropped.
    async fn bury(
        &self,
        route: &Route<S::Tx>,
        delivery: &Delivery,
        kind: &'static str,
        last: AttemptError,
    ) -> Outcome {
        let msg = &delivery.message;
        let mut attempts = match self.store.failure_history(&route.group, &msg.id).await {
            Ok(history) => history,
            Err(err) => {
                tracing::warn!(error = %err, "could not read the failure history");
                Vec::new()
            }
        };
        // The store may round `at`; compare what the attempt was instead.
        if !attempts
            .iter()
            .any(|a| a.attempt == last.attempt && a.error == last.error)
        {
            attempts.push(last);
        }
        let letter = DeadLetter {
            id: dead_letter::letter_id(&route.group, &msg.id),
            message: msg.clone(),
            group: route.group.to_string(),
            error_kind: kind.to_owned(),
            attempts,
            dead_at: keel_core::clock::utc_now(),
            status: DeadLetterStatus::Pending,
        };
        match self.store.dead_letter_put(&letter).await {
            Ok(()) | Err(crate::store::StoreError::Conflict(_)) => {}
            Err(err) => {
                let delay = self.redelivery_delay(delivery.delivery_count);
                tracing::error!(error = %err, ?delay,
                    "could not dead-letter the message; it will be delivered again");
                self.settle_nack(route, delivery, delay).await;
                return Outcome::Retried;
            }
        }
        fail::fail_point!("consumer-after-dead-letter", |_| Outcome::Crashed(
            "consumer-after-dead-letter"
        ));
        tracing::warn!(kind, letter = %letter.id, attempts = letter.attempts.len(),
            error = letter.attempts.last().map(|a| a.error.as_str()).unwrap_or_default(),
            "message dead-lettered");
        metrics::counter!(
            "keel_consumer_dead_lettered_total",
            route.labels_with("kind", kind)
        )
        .increment(1);
        if let Err(err) = delivery.terminate().await {
            tracing::warn!(error = %err, "could not terminate the dead-lettered delivery; \
                a redelivery will find the letter already stored");
        }
        self.forget_failures(route, msg).await;
        Outcome::DeadLettered(kind)
    }

    /// Deletes inbox rows older than the retention, in bounded batches.
    pub(crate) async fn prune_inbox(
        &self,
        retention: Duration,
    ) -> Result<u64, crate::store::StoreError> {
        let age = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
        let before = keel_core::clock::utc_now()
            .checked_sub_signed(age)
            .unwrap_or(chrono::DateTime::<Utc>::MIN_UTC);
        let total = crate::store::delete_in_batches(INBOX_PRUNE_BATCH, || {
            self.store.inbox_prune(before, INBOX_PRUNE_BATCH)
        })
        .await?;
        if total > 0 {
            metrics::counter!("keel_consumer_inbox_pruned_total").increment(total);
            tracing::info!(rows = total, "inbox pruned");
        }
        Ok(total)
    }

    async fn forget_failures(&self, route: &Route<S::Tx>, msg: &Message) {
        if let Err(err) = self.store.failure_clear(&route.group, &msg.id).await {
            tracing::debug!(error = %err, "could not clear the failure history");
        }
    }

    async fn settle_ack(&self, route: &Route<S::Tx>, delivery: &Delivery) {
        if let Err(err) = delivery.ack().await {
            settle_failed(route, "ack", &err);
        }
    }

    pub(crate) async fn settle_nack(
        &self,
        route: &Route<S::Tx>,
        delivery: &Delivery,
        delay: Duration,
    ) {
        if let Err(err) = delivery.nack(delay).await {
            settle_failed(route, "nack", &err);
        }
    }
}

fn settle_failed<Tx>(route: &Route<Tx>, op: &str, err: &BrokerError) {
    if matches!(err, BrokerError::LeaseLost) {
        metrics::counter!("keel_consumer_lease_lost_total", route.labels.iter()).increment(1);
    }
    tracing::warn!(op, error = %err,
        "could not settle the delivery; it will be redelivered and deduped by the inbox");
}

/// Runs `fut` while extending `delivery`'s lease every `extend_every`.
async fn keep_lease<F: Future>(
    delivery: &Delivery,
    options: &ConsumerOptions,
    fut: F,
) -> F::Output {
    let every = options.extend_every();
    let mut fut = pin!(fut);
    let mut ticker = tokio::time::interval_at(clock::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut extending = true;
    loop {
        tokio::select! {
            out = &mut fut => return out,
            _ = ticker.tick(), if extending => {
                match delivery.extend_lease(options.lease).await {
                    Ok(()) => tracing::trace!("lease extended"),
                    Err(BrokerError::LeaseLost) => {
                        tracing::warn!("lease lost while the handler runs; another consumer \
                            may get the message, and the inbox keeps it to one effect");
                        extending = false;
                    }
                    Err(err) => tracing::warn!(error = %err, "could not extend the lease"),
                }
            }
        }
    }
}

fn read_deadline(msg: &Message) -> Option<Deadline> {
    let raw = msg.header(header::DEADLINE)?;
    match Deadline::parse_header(raw) {
        Ok(d) => Some(d),
        Err(err) => {
            tracing::warn!(error = %err, "ignoring an unreadable deadline header");
            None
        }
    }
}

/// Structured mode, or binary mode when the headers say so.
fn decode(msg: &Message) -> Result<Envelope, EnvelopeError> {
    match Envelope::from_json(&msg.payload) {
        Ok(env) => Ok(env),
        Err(err) if !msg.headers.contains_key("ce-specversion") => Err(err),
        Err(_) => Envelope::from_binary(
            msg.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &msg.payload,
        ),
    }
}

/// `envelope` with `time` set to when the broker received the message, if
/// the broker says (to the millisecond, as `ce-time` carries it).
fn with_broker_time(mut envelope: Envelope, delivery: &Delivery) -> Envelope {
    if let Some(at) = delivery.received_at() {
        envelope.time = Some(chrono::SubsecRound::trunc_subsecs(at, 3));
    }
    envelope
}

/// The inbox key: the `event-id` header (kept across DLQ replays, which get a
/// fresh message id), else the envelope id.
fn event_id(msg: &Message, envelope: &Envelope) -> String {
    match msg.header(header::EVENT_ID) {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => envelope.id.clone(),
    }
}
