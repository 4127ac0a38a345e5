//! Queueing webhooks: events become deliveries in the caller's transaction,
//! never HTTP calls inside the request that caused them.
//!
//! A customer's slow or broken endpoint must not be inside your own
//! latency, and an event must not be announced for a change that rolled
//! back. So [`WebhookOutbox::enqueue`] writes one delivery row per
//! subscribed endpoint in the *same* transaction as the business change (or,
//! through [`WebhookFanout`], in the transaction of an outbox consumer that
//! reads the event off the broker), and the [`DeliveryWorker`] sends them
//! afterwards.
//!
//! The body queued is the Standard Webhooks payload shape, with the event
//! id, an optional sequence number (so a receiver can dedupe and order) and
//! an optional source added:
//!
//! ```json
//! {"id":"evt_0190f5c4...","type":"order.paid","timestamp":"2026-11-29T10:00:00.000Z","sequence":7,"source":"/shop/orders","data":{...}}
//! ```
//!
//! An endpoint whose [`WebhookFormat`](super::WebhookFormat) is CloudEvents
//! receives it as a CloudEvent instead (see [`super::wire`]).
//!
//! `timestamp` is when the event *occurred*, not when it was sent: retries
//! mean a refund can arrive before the payment it refunds, and receivers
//! order by it (or by `sequence`), never by arrival.
//!
//! [`DeliveryWorker`]: super::DeliveryWorker

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use keel_messaging::consumer::{DeliveryInfo, Handler, HandlerError};
use keel_store::envelope::Envelope;
use keel_store::{WebhookDeliveryStore, WebhookMessage};
use serde::Serialize;

use super::WallClock;
use super::error::WebhookError;
use super::signing::MAX_ID_LEN;

/// The largest body queued by default: 256 KiB. Webhooks carry what
/// happened, not the database; send ids for the rest.
pub const DEFAULT_MAX_PAYLOAD: usize = 256 * 1024;

/// The longest event type accepted, in characters.
pub const MAX_EVENT_TYPE_LEN: usize = 255;

/// An event to send to every endpoint subscribed to its type.
///
/// ```
/// use keel_webhooks::WebhookEvent;
///
/// let event = WebhookEvent::new("order.paid", serde_json::json!({"orderId": "A-4471"}))
///     .with_id("evt_A-4471-paid")
///     .with_sequence(7);
/// let body: serde_json::Value = serde_json::from_slice(&event.to_body().unwrap()).unwrap();
/// assert_eq!(body["type"], "order.paid");
/// assert_eq!(body["id"], "evt_A-4471-paid");
/// assert_eq!(body["sequence"], 7);
/// assert_eq!(body["data"]["orderId"], "A-4471");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookEvent {
    /// The event id, sent as `webhook-id` and in the body; receivers dedupe
    /// on it (delivery is at least once).
    pub id: String,
    /// The event type (`order.paid`).
    pub event_type: String,
    /// When it happened (the body's `timestamp`).
    pub occurred_at: DateTime<Utc>,
    /// A number increasing per entity or stream, if you have one (the
    /// entity's version, an event log's seq): lets receivers order events.
    pub sequence: Option<i64>,
    /// The event's data.
    pub data: serde_json::Value,
    /// Who produced it, a URI reference (a CloudEvents `source`); absent,
    /// CloudEvents endpoints get [`DEFAULT_SOURCE`](super::DEFAULT_SOURCE).
    pub source: Option<String>,
}

impl WebhookEvent {
    /// An event of `event_type` that occurred now, with a new `evt_<uuidv7>` id.
    pub fn new(event_type: impl Into<String>, data: serde_json::Value) -> Self {
        Self {
            id: format!("evt_{}", keel_core::id::new_id().simple()),
            event_type: event_type.into(),
            occurred_at: WallClock::system().now(),
            sequence: None,
            data,
            source: None,
        }
    }

    /// Sets who produced it (the CloudEvents `source`).
    pub fn with_source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Sets the id (use your domain event's id, so the same event always
    /// has the same webhook id).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Sets the sequence number.
    pub fn with_sequence(mut self, sequence: i64) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// Sets when the event occurred.
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = at;
        self
    }

    /// The webhook for a CloudEvents envelope consumed from the broker: its
    /// id, type, occurrence time (the `keel` meta, or `time`) and data; the
    /// entity version, if the envelope has one, is the sequence.
    pub fn from_envelope(envelope: &Envelope) -> Self {
        Self {
            id: envelope.id.clone(),
            event_type: envelope.ty.clone(),
            occurred_at: envelope
                .occurred_at()
                .or(envelope.time)
                .unwrap_or_else(|| WallClock::system().now()),
            sequence: envelope.version().and_then(|v| i64::try_from(v).ok()),
            data: envelope.data.clone().unwrap_or(serde_json::Value::Null),
            source: Some(envelope.source.clone()),
        }
    }

    /// The JSON body sent (and signed).
    pub fn to_body(&self) -> Result<Vec<u8>, WebhookError> {
        #[derive(Serialize)]
        struct Body<'a> {
            id: &'a str,
            #[serde(rename = "type")]
            event_type: &'a str,
            timestamp: String,
            #[serde(skip_serializing_if = "Option::is_none")]
            sequence: Option<i64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            source: Option<&'a str>,
            data: &'a serde_json::Value,
        }
        serde_json::to_vec(&Body {
            id: &self.id,
            event_type: &self.event_type,
            timestamp: self
                .occurred_at
                .to_rfc3339_opts(SecondsFormat::Millis, true),
            sequence: self.sequence,
            source: self.source.as_deref(),
            data: &self.data,
        })
        .map_err(|e| WebhookError::invalid("data", e.to_string()))
    }

    /// The stored message, refusing a body over `max_payload` bytes.
    pub fn to_message(&self, max_payload: usize) -> Result<WebhookMessage, WebhookError> {
        let body = self.to_body()?;
        check_message(&self.id, &self.event_type, body.len(), max_payload)?;
        Ok(WebhookMessage {
            event_id: self.id.clone(),
            event_type: self.event_type.clone(),
            payload: Bytes::from(body),
            traceparent: keel_core::TraceParent::current().map(|t| t.to_string()),
        })
    }
}

/// Checks the parts of a message that become headers or that receivers
/// rely on.
pub(crate) fn check_message(
    id: &str,
    event_type: &str,
    size: usize,
    max_payload: usize,
) -> Result<(), WebhookError> {
    if id.is_empty() || id.len() > MAX_ID_LEN || !id.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(WebhookError::invalid(
            "event id",
            format!(
                "{id:?} must be 1 to {MAX_ID_LEN} visible ASCII characters (it is sent as webhook-id)"
            ),
        ));
    }
    if event_type.is_empty() || event_type.len() > MAX_EVENT_TYPE_LEN {
        return Err(WebhookError::invalid(
            "event type",
            format!("must be 1 to {MAX_EVENT_TYPE_LEN} characters"),
        ));
    }
    if size > max_payload {
        return Err(WebhookError::PayloadTooLarge {
            size,
            limit: max_payload,
        });
    }
    Ok(())
}

/// Queues webhook deliveries in the caller's transaction.
///
/// ```
/// use keel_webhooks::{Endpoints, NewEndpoint, WebhookEvent, WebhookOutbox};
/// use keel_webhooks::ssrf::SsrfGuard;
/// use keel_store::{Store, WebhookStore};
/// use keel_sqlite::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let store = SqliteStore::open_in_memory().await?;
/// let endpoints = Endpoints::new(store.clone(), SsrfGuard::new());
/// let (endpoint, secret) = endpoints
///     .create(NewEndpoint::new("https://93.184.215.14/hooks").event_types(["order.*"]))
///     .await?;
/// // Show `secret.expose()` to the endpoint's owner once.
/// # let _ = secret;
///
/// let outbox = WebhookOutbox::new(store.clone());
/// let mut tx = store.begin().await?;
/// // ... write the order in `tx` ...
/// let event = WebhookEvent::new("order.paid", serde_json::json!({"orderId": "A-4471"}));
/// assert_eq!(outbox.enqueue(&mut tx, &[event]).await?, 1);
/// store.commit(tx).await?;
///
/// let queued = endpoints.deliveries(&Default::default()).await?;
/// assert_eq!(queued[0].endpoint_id, endpoint.id);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct WebhookOutbox<S> {
    store: S,
    max_payload: usize,
    clock: WallClock,
}

impl<S: WebhookDeliveryStore> WebhookOutbox<S> {
    /// Queues into `store`, refusing payloads over [`DEFAULT_MAX_PAYLOAD`].
    pub fn new(store: S) -> Self {
        Self {
            store,
            max_payload: DEFAULT_MAX_PAYLOAD,
            clock: WallClock::system(),
        }
    }

    /// The largest body accepted, in bytes.
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// The clock that stamps deliveries (default: the system's).
    pub fn clock(mut self, clock: WallClock) -> Self {
        self.clock = clock;
        self
    }

    /// Queues `events` for every subscribed endpoint inside `tx`; returns
    /// how many deliveries were queued. Nothing is sent here: the deliveries
    /// commit (or roll back) with `tx`, and a worker sends them. An event
    /// already queued (same id) is not queued again. Every event is checked
    /// first, so a refused one queues nothing.
    pub async fn enqueue(
        &self,
        tx: &mut S::Tx,
        events: &[WebhookEvent],
    ) -> Result<u64, WebhookError> {
        let messages = events
            .iter()
            .map(|event| event.to_message(self.max_payload))
            .collect::<Result<Vec<_>, _>>()?;
        self.enqueue_messages(tx, &messages).await
    }

    /// Like [`enqueue`](Self::enqueue), for bodies you serialised yourself.
    pub async fn enqueue_messages(
        &self,
        tx: &mut S::Tx,
        messages: &[WebhookMessage],
    ) -> Result<u64, WebhookError> {
        for message in messages {
            check_message(
                &message.event_id,
                &message.event_type,
                message.payload.len(),
                self.max_payload,
            )?;
        }
        let queued = self
            .store
            .webhook_enqueue(tx, messages, self.clock.now())
            .await?;
        metrics::counter!("keel_webhook_queued_total").increment(queued);
        tracing::debug!(events = messages.len(), queued, "webhook deliveries queued");
        Ok(queued)
    }
}

/// An outbox-consumer handler that queues a webhook for every event it
/// consumes, in the consumer's transaction (with its inbox row), so each
/// event is queued once even when the broker redelivers it.
///
/// Register it for the event types that customers may subscribe to:
/// `Group::new("orders", "webhooks").on("order.paid", WebhookFanout::new(outbox))`.
#[derive(Debug, Clone)]
pub struct WebhookFanout<S> {
    outbox: WebhookOutbox<S>,
}

impl<S: WebhookDeliveryStore> WebhookFanout<S> {
    /// A handler queueing through `outbox`.
    pub fn new(outbox: WebhookOutbox<S>) -> Self {
        Self { outbox }
    }
}

#[async_trait]
impl<S> Handler<S::Tx> for WebhookFanout<S>
where
    S: WebhookDeliveryStore,
{
    async fn handle(
        &self,
        tx: &mut S::Tx,
        envelope: &Envelope,
        _info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let event = WebhookEvent::from_envelope(envelope);
        match self.outbox.enqueue(tx, &[event]).await {
            Ok(_) => Ok(()),
            Err(WebhookError::Store(err)) => Err(HandlerError::classify(err)),
            // Too large or malformed: no retry will fix it.
            Err(other) => Err(HandlerError::permanent(other)),
        }
    }
}
