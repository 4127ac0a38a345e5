//! The transactional outbox: write the event in the business transaction,
//! publish it afterwards.
//!
//! Writing a row and publishing a message are two systems; no code can make
//! both happen or neither ("dual write"). The outbox makes it one system: the
//! event is a row in the *same* database transaction as the business change,
//! so it exists if and only if the change committed. The
//! [`OutboxRelay`] then reads unpublished rows and publishes them to the
//! broker, at least once.
//!
//! Five things outbox implementations often miss, and where each lives in
//! Keel:
//!
//! 1. **`event_id` on the row AND on the message.** [`Outbox::append`] writes
//!    the envelope id as the row's event id, the message id, and the
//!    `event-id` header, so consumers can dedupe the relay's republishes.
//! 2. **`partition_key` on the row.** The envelope's subject (the entity id)
//!    becomes the partition key, keeping per-entity order on the broker.
//! 3. **`FOR UPDATE SKIP LOCKED` (or a single leader).** The relay *claims*
//!    rows with a lease ([`OutboxStore::outbox_claim`]), so several relays
//!    never publish the same row at the same time.
//! 4. **A partial index on unpublished rows**, in each backend's migration,
//!    so the relay's query stays fast as published rows pile up.
//! 5. **A prune job.** The relay deletes published rows older than a
//!    retention (default 7 days), in bounded batches.
//!
//! ```
//! use keel_messaging::envelope::{Envelope, Event, EventMeta};
//! use keel_messaging::outbox::{Outbox, OutboxError};
//! use keel_messaging::store::OutboxStore;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct OrderPlaced { order_id: String, total_minor: i64 }
//!
//! impl Event for OrderPlaced {
//!     const TYPE: &'static str = "shop.order.placed.v1";
//!     fn subject(&self) -> String { self.order_id.clone() }
//! }
//!
//! async fn place_order<S: OutboxStore>(outbox: &Outbox<S>) -> Result<(), OutboxError> {
//!     let mut tx = outbox.store().begin().await?;
//!     // ... insert the order with your own SQL in `tx` ...
//!     let placed = OrderPlaced { order_id: "A-4471".into(), total_minor: 8210 };
//!     let env = Envelope::from_event("/services/orders", &placed, EventMeta::new(1))?;
//!     outbox.append(&mut tx, "orders", &env).await?;
//!     // Commits, then wakes the relay so the event leaves at once.
//!     outbox.commit(tx).await?;
//!     Ok(())
//! }
//! ```

pub mod relay;

pub use relay::{
    DEFAULT_BATCH_SIZE, DEFAULT_LEASE, DEFAULT_POLL_INTERVAL, DEFAULT_PRUNE_BATCH,
    DEFAULT_PRUNE_INTERVAL, DEFAULT_RETENTION, DEFAULT_STATS_INTERVAL, OutboxRelay, RelayBuilder,
    RelayError, RelayOptions,
};

use std::sync::Arc;

use keel_core::{Classify, ErrorClass};
use tokio::sync::Notify;

use crate::broker::{Broker, BrokerError, Headers, Message, header};
use crate::envelope::{DEFAULT_MAX_SIZE, Envelope, EnvelopeError, Event, EventMeta};
use crate::store::{OutboxRecord, OutboxStore, StoreError};

/// The `content-type` header Keel puts on structured-mode events.
pub const CONTENT_TYPE_HEADER: &str = "content-type";

/// Appends events to the outbox inside the caller's transaction, and wakes
/// the relay after commit. Cheap to clone; clones share the wake-up.
///
/// Forgetting to wake the relay ([`commit`](Self::commit) or
/// [`notify`](Self::notify)) costs latency, never events: the relay also
/// polls (every 200 ms by default).
#[derive(Debug, Clone)]
pub struct Outbox<S> {
    store: S,
    max_size: usize,
    wake: Arc<Notify>,
    broker_check: Option<BrokerCheck>,
}

/// The configured broker's [`Broker::validate`], kept by the outbox.
#[derive(Clone)]
struct BrokerCheck(Arc<CheckFn>);

type CheckFn = dyn Fn(&Message) -> Result<(), BrokerError> + Send + Sync;

impl std::fmt::Debug for BrokerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerCheck")
    }
}

impl<S: OutboxStore> Outbox<S> {
    /// An outbox on `store`, refusing envelopes over
    /// [`DEFAULT_MAX_SIZE`] (100 KiB).
    pub fn new(store: S) -> Self {
        Self {
            store,
            max_size: DEFAULT_MAX_SIZE,
            wake: Arc::new(Notify::new()),
            broker_check: None,
        }
    }

    /// Refuses, at append time, every event `broker` could never accept
    /// (its [`Broker::validate`]: a key or header it cannot carry, a
    /// message over its size limit) with [`OutboxError::Unpublishable`],
    /// before anything is written. Without it such an event commits, and
    /// the relay parks it when the broker refuses it, holding back its key
    /// until an operator acts.
    pub fn with_broker<B: Broker + ?Sized>(mut self, broker: Arc<B>) -> Self {
        self.broker_check = Some(BrokerCheck(Arc::new(move |m: &Message| broker.validate(m))));
        self
    }

    /// Sets the largest encoded envelope accepted, in bytes. Larger events
    /// are refused with [`EnvelopeError::TooLarge`], which points to the
    /// claim check.
    pub fn with_max_size(mut self, bytes: usize) -> Self {
        self.max_size = bytes;
        self
    }

    /// The store the outbox writes to.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The largest encoded envelope accepted, in bytes.
    pub fn max_size(&self) -> usize {
        self.max_size
    }

    /// Adds `envelope` to `topic`, inside `tx`. The event is published only
    /// if `tx` commits.
    pub async fn append(
        &self,
        tx: &mut S::Tx,
        topic: &str,
        envelope: &Envelope,
    ) -> Result<(), OutboxError> {
        let record = self.record(topic, envelope)?;
        self.store
            .outbox_append(tx, std::slice::from_ref(&record))
            .await?;
        Ok(())
    }

    /// Adds several envelopes to `topic`, in order, inside `tx`.
    pub async fn append_all<'a, I>(
        &self,
        tx: &mut S::Tx,
        topic: &str,
        envelopes: I,
    ) -> Result<(), OutboxError>
    where
        I: IntoIterator<Item = &'a Envelope>,
    {
        let records = envelopes
            .into_iter()
            .map(|env| self.record(topic, env))
            .collect::<Result<Vec<_>, _>>()?;
        if records.is_empty() {
            return Ok(());
        }
        self.store.outbox_append(tx, &records).await?;
        Ok(())
    }

    /// Wraps a typed event in an envelope from `source` and adds it to
    /// `topic` inside `tx`; returns the envelope (its id is the event id).
    pub async fn append_event<E: Event>(
        &self,
        tx: &mut S::Tx,
        topic: &str,
        source: &str,
        event: &E,
        meta: EventMeta,
    ) -> Result<Envelope, OutboxError> {
        let envelope = Envelope::from_event(source, event, meta)?;
        self.append(tx, topic, &envelope).await?;
        Ok(envelope)
    }

    /// Commits `tx` and wakes the relay: the way to finish a business
    /// transaction that appended events.
    pub async fn commit(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.store.commit(tx).await?;
        self.notify();
        Ok(())
    }

    /// Wakes the relay now (after a commit made elsewhere). A wake-up with
    /// no relay waiting is kept for the next wait, so none is lost.
    pub fn notify(&self) {
        self.wake.notify_one();
    }

    /// The outbox row for `envelope` on `topic`: the envelope id as event
    /// id, the subject as partition key, and the `event-id`, `traceparent`,
    /// `ce-type` and `content-type` headers. Refuses an invalid envelope,
    /// one over the size limit, and one the broker given to
    /// [`with_broker`](Self::with_broker) could never accept.
    pub fn record(&self, topic: &str, envelope: &Envelope) -> Result<OutboxRecord, OutboxError> {
        envelope.validate()?;
        let envelope = &created(topic, envelope);
        let payload = envelope.to_json_limited(self.max_size)?;
        let record = OutboxRecord {
            event_id: envelope.id.clone(),
            topic: topic.to_owned(),
            partition_key: envelope.partition_key().to_owned(),
            headers: headers_for(envelope),
            payload: payload.into(),
        };
        if let Some(BrokerCheck(check)) = &self.broker_check {
            check(&record.to_message()).map_err(|reason| OutboxError::Unpublishable {
                event_id: record.event_id.clone(),
                topic: record.topic.clone(),
                key: record.partition_key.clone(),
                reason,
            })?;
        }
        Ok(record)
    }

    /// The relay's wake-up, for a source of rows that learns of commits
    /// itself (keel-postgres's `WalOutbox`, as transactions stream in).
    /// Holding it keeps nothing else alive, unlike a clone of the outbox.
    pub fn waker(&self) -> Arc<Notify> {
        Arc::clone(&self.wake)
    }
}

/// `envelope` as its producer span made it: the span (a child of the
/// trace the event was made in) is started here, and its context is what
/// the row, the relay and the consumer carry on.
fn created(topic: &str, envelope: &Envelope) -> Envelope {
    let span = tracing::info_span!(
        "outbox.create",
        otel.name = %format_args!("create {topic}"),
        otel.kind = "producer",
        "messaging.system" = "keel",
        "messaging.operation.type" = "create",
        "messaging.destination.name" = topic,
        "messaging.message.id" = %envelope.id,
    );
    let parent = envelope.trace_parent();
    let state = envelope.trace_state();
    let context = keel_core::trace::span::child(&span, parent.as_ref(), state.as_ref());
    let mut envelope = envelope.clone();
    envelope.traceparent = Some(context.to_string());
    envelope
}

fn headers_for(envelope: &Envelope) -> Headers {
    let mut headers = Headers::new();
    headers.insert(header::EVENT_ID.to_owned(), envelope.id.clone());
    headers.insert(header::EVENT_TYPE.to_owned(), envelope.ty.clone());
    headers.insert(
        CONTENT_TYPE_HEADER.to_owned(),
        crate::envelope::STRUCTURED_CONTENT_TYPE.to_owned(),
    );
    if let Some(tp) = &envelope.traceparent {
        headers.insert(header::TRACEPARENT.to_owned(), tp.clone());
    }
    if let Some(state) = &envelope.tracestate {
        headers.insert(header::TRACESTATE.to_owned(), state.clone());
    }
    headers
}

/// An event could not be put in the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The envelope is invalid or too large; fix the event (or send a claim
    /// check for a large payload). The transaction is still usable.
    #[error("event refused by the outbox: {0}")]
    Envelope(#[from] EnvelopeError),
    /// The configured broker could never publish this event (see
    /// [`Outbox::with_broker`]): nothing was written, and the transaction
    /// is still usable. Fix the event: a key or header without line breaks
    /// or characters the broker cannot carry, or a smaller payload (a claim
    /// check for a large one).
    #[error(
        "event {event_id} (topic {topic:?}, key {key:?}) was not written: the broker could \
         never publish it ({reason}); fix its key, headers or size (put a large payload in a \
         claim check)"
    )]
    Unpublishable {
        /// The event id.
        event_id: String,
        /// The topic it was for.
        topic: String,
        /// Its partition key.
        key: String,
        /// What the broker refuses.
        #[source]
        reason: BrokerError,
    },
    /// The store failed; the business transaction should be rolled back and
    /// retried if the error is transient.
    #[error("outbox write failed: {0}")]
    Store(#[from] StoreError),
}

impl Classify for OutboxError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Envelope(_) | Self::Unpublishable { .. } => ErrorClass::Permanent,
            Self::Store(e) => e.class(),
        }
    }
}

#[cfg(test)]
mod tests;
