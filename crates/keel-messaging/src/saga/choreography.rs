//! Choreography: sagas with no orchestrator, where each participant reacts
//! to one event and emits the next through its outbox.
//!
//! A [`Reaction`] is a consumer [`Handler`]: it decodes the incoming event
//! (tolerant reader), runs your closure inside the consumer's transaction
//! (the inbox row commits with it), and appends the follow-up event to the
//! outbox in the *same* transaction, so "handled" and "next event
//! published" cannot disagree. The follow-up's id is derived from the
//! cause (`<cause id>:<type>`), not random, and it carries `causationid`
//! and `correlationid` extensions and the cause's trace, so "why is order
//! A-4471 stuck?" can be answered by following ids across services, not
//! only by hoping everyone propagated the trace.
//!
//! Choose choreography for two or three stable steps owned by one team;
//! past that, or when a human may need to intervene, use the
//! [orchestrator](super::SagaOrchestrator).

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::consumer::{DeliveryInfo, Handler, HandlerError};
use crate::envelope::{Envelope, EnvelopeError, Event, EventMeta};
use crate::outbox::Outbox;
use crate::store::OutboxStore;

/// The extension naming the event that caused this one.
pub const CAUSATION_ID: &str = "causationid";

/// The extension shared by every event of one saga instance (the first
/// event's id unless a cause already carries one).
pub const CORRELATION_ID: &str = "correlationid";

/// The event a reaction emits, with its entity version.
#[derive(Debug, Clone, PartialEq)]
pub struct Next<E> {
    /// The event.
    pub event: E,
    /// When it happened and the entity's version after it.
    pub meta: EventMeta,
}

impl<E> Next<E> {
    /// `event`, leaving its entity at `version`, happening now.
    pub fn new(event: E, version: u64) -> Self {
        Self {
            event,
            meta: EventMeta::new(version),
        }
    }

    /// Sets when the fact happened.
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.meta.occurred_at = at;
        self
    }
}

/// The envelope for `next`, caused by `cause`: a derived id
/// (`<cause id>:<type>`, so handling the cause twice cannot emit twice),
/// `causationid` and `correlationid` extensions, and the cause's trace
/// continued.
pub fn follow_up<E: Event>(
    source: &str,
    cause: &Envelope,
    next: &Next<E>,
) -> Result<Envelope, EnvelopeError> {
    let mut envelope = Envelope::from_event(source, &next.event, next.meta)?;
    envelope.id = format!("{}:{}", cause.id, E::TYPE);
    if let Some(tp) = cause.trace_parent() {
        envelope.traceparent = Some(tp.to_string());
    }
    let correlation = cause
        .extensions
        .get(CORRELATION_ID)
        .cloned()
        .unwrap_or_else(|| Value::String(cause.id.clone()));
    envelope
        .extensions
        .insert(CAUSATION_ID.to_owned(), Value::String(cause.id.clone()));
    envelope
        .extensions
        .insert(CORRELATION_ID.to_owned(), correlation);
    Ok(envelope)
}

/// What a reaction closure returns: the next event, if any.
pub type ReactionFuture<'a, Out> =
    Pin<Box<dyn Future<Output = Result<Option<Next<Out>>, HandlerError>> + Send + 'a>>;

/// A reaction's closure: given the transaction, the decoded event and its
/// envelope, the next event. Every closure of that shape is one.
pub trait ReactionFn<Tx, In, Out>:
    for<'a> Fn(&'a mut Tx, In, &'a Envelope) -> ReactionFuture<'a, Out> + Send + Sync + 'static
{
}

impl<Tx, In, Out, F> ReactionFn<Tx, In, Out> for F where
    F: for<'a> Fn(&'a mut Tx, In, &'a Envelope) -> ReactionFuture<'a, Out> + Send + Sync + 'static
{
}

/// One participant's step in a choreographed saga: when `In` arrives, do
/// the local work in the transaction and emit `Out` to a topic. Register it
/// with a consumer group under `In::TYPE`.
pub struct Reaction<S, In, Out, F> {
    outbox: Outbox<S>,
    source: String,
    topic: String,
    f: F,
    _events: PhantomData<fn(In) -> Out>,
}

impl<S, In, Out, F> fmt::Debug for Reaction<S, In, Out, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reaction")
            .field("in", &std::any::type_name::<In>())
            .field("out", &std::any::type_name::<Out>())
            .field("source", &self.source)
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

/// A reaction: on `In`, run `f` in the consumer's transaction, and append
/// the event it returns (from `source`) to `topic` in the same transaction.
///
/// ```no_run
/// # use keel_messaging::saga::choreography::{reaction, Next};
/// # use keel_messaging::outbox::Outbox;
/// # use keel_messaging::store::OutboxStore;
/// # use keel_messaging::Event;
/// # use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize)]
/// struct OrderPlaced { order_id: String }
/// impl Event for OrderPlaced {
///     const TYPE: &'static str = "shop.order.placed.v1";
///     fn subject(&self) -> String { self.order_id.clone() }
/// }
/// #[derive(Serialize, Deserialize)]
/// struct StockReserved { order_id: String }
/// impl Event for StockReserved {
///     const TYPE: &'static str = "shop.stock.reserved.v1";
///     fn subject(&self) -> String { self.order_id.clone() }
/// }
/// # fn demo<S: OutboxStore>(outbox: Outbox<S>) {
/// let reserve = reaction(outbox, "/services/inventory", "stock", |_tx, placed: OrderPlaced, _env| {
///     Box::pin(async move {
///         // ... reserve the stock with the transaction ...
///         Ok(Some(Next::new(StockReserved { order_id: placed.order_id }, 1)))
///     })
/// });
/// # let _ = reserve; }
/// ```
pub fn reaction<S, In, Out, F>(
    outbox: Outbox<S>,
    source: impl Into<String>,
    topic: impl Into<String>,
    f: F,
) -> Reaction<S, In, Out, F>
where
    S: OutboxStore,
    In: Event + Send + 'static,
    Out: Event + Send + Sync + 'static,
    F: for<'a> Fn(&'a mut S::Tx, In, &'a Envelope) -> ReactionFuture<'a, Out>
        + Send
        + Sync
        + 'static,
{
    Reaction {
        outbox,
        source: source.into(),
        topic: topic.into(),
        f,
        _events: PhantomData,
    }
}

impl<S, In, Out, F> Reaction<S, In, Out, F>
where
    S: OutboxStore,
    In: Event + Send + 'static,
    Out: Event + Send + Sync + 'static,
    F: ReactionFn<S::Tx, In, Out>,
{
    /// Reacts to `cause` inside `tx`; returns the envelope appended to the
    /// outbox, if any. An event of another type is refused as malformed
    /// (the consumer dead-letters it), never silently skipped.
    pub async fn react(
        &self,
        tx: &mut S::Tx,
        cause: &Envelope,
    ) -> Result<Option<Envelope>, HandlerError> {
        if cause.ty != In::TYPE {
            return Err(HandlerError::permanent(EnvelopeError::Invalid {
                attribute: "type",
                reason: "this reaction handles another event type",
            }));
        }
        let event: In = cause.data_as()?;
        let Some(next) = (self.f)(tx, event, cause).await? else {
            return Ok(None);
        };
        let envelope = follow_up(&self.source, cause, &next)?;
        self.outbox
            .append(tx, &self.topic, &envelope)
            .await
            .map_err(HandlerError::classify)?;
        metrics::counter!("keel_choreography_emitted_total", "type" => Out::TYPE).increment(1);
        tracing::debug!(cause = %cause.id, next = %envelope.id, ty = Out::TYPE, "reaction emitted");
        Ok(Some(envelope))
    }
}

#[async_trait]
impl<S, In, Out, F> Handler<S::Tx> for Reaction<S, In, Out, F>
where
    S: OutboxStore,
    In: Event + Send + 'static,
    Out: Event + Send + Sync + 'static,
    F: ReactionFn<S::Tx, In, Out>,
{
    async fn handle(
        &self,
        tx: &mut S::Tx,
        envelope: &Envelope,
        _info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        self.react(tx, envelope).await.map(drop)
    }
}
