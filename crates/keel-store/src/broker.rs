//! The broker contract: durable topics, consumer groups, leases, acks.
//!
//! Keel ships four implementations: the embedded broker on SQLite
//! (`keel-sqlite`, the default), NATS JetStream (`keel-nats`), RabbitMQ
//! (`keel-rabbitmq`) and Kafka (`keel-kafka`). All pass the same
//! conformance suite (`keel-testkit`),
//! which is the precise meaning of every sentence below.
//!
//! Semantics every [`Broker`] provides:
//!
//! - **At-least-once.** A delivery that is not acked before its lease expires
//!   is delivered again, with [`Delivery::delivery_count`] one higher.
//! - **Consumer groups.** Every group on a topic receives every message; within
//!   a group, each message goes to one consumer at a time. A group created
//!   after messages were published starts where [`Broker::group_start`]
//!   says: at the oldest message the topic retains, or (RabbitMQ) at its
//!   creation, which is why [`Broker::declare_group`] exists.
//! - **Per-key order.** Within a group, a message is not delivered while an
//!   earlier message with the same [`Message::key`] is unacked.
//! - **Publisher dedupe.** A message whose id was already published on the
//!   topic (within the broker's dedupe window) is accepted and dropped.
//! - **Ack last.** Consumers ack only after their effect committed (the
//!   consumer runtime in `keel-messaging` does).

pub mod held;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_core::{BoxError, Classify, ErrorClass};

/// Message headers. Small, ordered, and string-valued like every broker's.
pub type Headers = BTreeMap<String, String>;

/// Header names Keel puts on every message.
pub mod header {
    /// The event id consumers dedupe on (also the message id).
    pub const EVENT_ID: &str = "event-id";
    /// W3C trace context of the producer.
    pub const TRACEPARENT: &str = "traceparent";
    /// The producer's W3C trace state, carried with `traceparent`.
    pub const TRACESTATE: &str = keel_core::trace::TRACESTATE_HEADER;
    /// The request deadline (Unix ms) for request-reply and time-bound work.
    pub const DEADLINE: &str = keel_core::deadline::DEADLINE_HEADER;
    /// Where a responder publishes its reply.
    pub const REPLY_TO: &str = "reply-to";
    /// Ties a reply to its request.
    pub const CORRELATION_ID: &str = "correlation-id";
    /// The event type, so routers need not parse the body.
    pub const EVENT_TYPE: &str = "ce-type";
}

/// The request-reply convention both ends speak, whichever broker carries
/// it (`keel-messaging`'s requester and responder over any [`Broker`],
/// `keel-nats`'s over core NATS, `keel-rabbitmq`'s over direct reply-to).
pub mod reply {
    use std::time::Duration;

    use bytes::Bytes;
    use keel_core::deadline::MIN_TIME_TO_START;
    use keel_core::{Classify, Deadline, ErrorClass};

    use super::Headers;

    /// A reply as the requester receives it.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Reply {
        /// The body.
        pub payload: Bytes,
        /// The reply's headers (`correlation-id` and `reply-status`
        /// included).
        pub headers: Headers,
    }

    impl Reply {
        /// The responder's reason, when this reply is a refusal
        /// ([`REPLY_STATUS`] is [`STATUS_ERROR`]).
        pub fn refusal(&self) -> Option<String> {
            (self.headers.get(REPLY_STATUS).map(String::as_str) == Some(STATUS_ERROR))
                .then(|| String::from_utf8_lossy(&self.payload).into_owned())
        }

        /// This reply, or [`ReplyError::Refused`] when it is a refusal.
        pub fn into_result(self) -> Result<Self, ReplyError> {
            match self.refusal() {
                Some(reason) => Err(ReplyError::Refused(reason)),
                None => Ok(self),
            }
        }
    }

    /// When a call that waits `timeout` must end (capped by the task's
    /// [`Deadline`]) and the time it has left, or
    /// [`ReplyError::DeadlineExceeded`] when too little is left to send it.
    pub fn call_deadline(timeout: Duration) -> Result<(Deadline, Duration), ReplyError> {
        let deadline = Deadline::after(timeout).min_with(Deadline::current());
        let remaining = deadline
            .check_start(MIN_TIME_TO_START)
            .map_err(|_| ReplyError::DeadlineExceeded)?;
        Ok((deadline, remaining))
    }

    /// A call of a broker's own request-reply (core NATS, RabbitMQ's direct
    /// reply-to) failed.
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum ReplyError {
        /// No reply arrived before the deadline. The responder may still do
        /// the work; retry only idempotent requests.
        #[error("no reply within {0:?}")]
        Timeout(Duration),
        /// The deadline left too little time to even send the request.
        #[error("the deadline left too little time to send the request")]
        DeadlineExceeded,
        /// Nobody listens on the subject or topic: start a responder, or
        /// retry later.
        #[error("no responder listens on {0}")]
        NoResponders(String),
        /// The responder's handler failed and said why.
        #[error("the responder refused: {0}")]
        Refused(String),
        /// A name, header or payload the broker refuses.
        #[error("invalid request: {0}")]
        Invalid(String),
        /// The connection failed; retry.
        #[error("broker unavailable: {0}")]
        Unavailable(String),
    }

    impl Classify for ReplyError {
        fn class(&self) -> ErrorClass {
            match self {
                Self::Timeout(_) => ErrorClass::OutcomeUnknown,
                Self::NoResponders(_) | Self::Unavailable(_) => ErrorClass::Retryable,
                Self::DeadlineExceeded | Self::Refused(_) | Self::Invalid(_) => {
                    ErrorClass::Permanent
                }
            }
        }
    }

    /// The header carrying the request id the responder dedupes on; stable
    /// across a caller's retries of one request.
    pub const REQUEST_ID: &str = "request-id";
    /// The header saying whether a reply is a result ([`STATUS_OK`]) or a
    /// refusal ([`STATUS_ERROR`], with the reason as the payload).
    pub const REPLY_STATUS: &str = "reply-status";
    /// [`REPLY_STATUS`] of a result.
    pub const STATUS_OK: &str = "ok";
    /// [`REPLY_STATUS`] of a refusal.
    pub const STATUS_ERROR: &str = "error";
    /// The default time a requester waits for a reply: 2 s, long enough for
    /// a queued request behind a busy responder, short enough that a caller
    /// gives up before its own caller does.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
    /// The prefix of per-process reply topics, which a broker's listing of
    /// topics tells apart from the application's.
    pub const REPLY_TOPIC_PREFIX: &str = "_reply.";
}

/// A message as published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Unique id (the event id); brokers dedupe publishes on it.
    pub id: String,
    /// The topic (stream) it belongs to.
    pub topic: String,
    /// The partition key: messages with the same key keep their order.
    pub key: String,
    /// Headers (event id, traceparent, ...).
    pub headers: Headers,
    /// The body, usually a structured-mode CloudEvent.
    pub payload: Bytes,
}

impl Message {
    /// A message with the given id, topic, key and payload, and the event-id
    /// and (if set) traceparent headers filled in.
    pub fn new(
        id: impl Into<String>,
        topic: impl Into<String>,
        key: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        let id = id.into();
        let mut headers = Headers::new();
        headers.insert(header::EVENT_ID.to_owned(), id.clone());
        if let Some(tp) = keel_core::TraceParent::current() {
            headers.insert(header::TRACEPARENT.to_owned(), tp.to_string());
        }
        if let Some(state) = keel_core::trace::TraceState::current() {
            headers.insert(header::TRACESTATE.to_owned(), state.to_string());
        }
        Self {
            id,
            topic: topic.into(),
            key: key.into(),
            headers,
            payload: payload.into(),
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Where and how a consumer group reads a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeOptions {
    /// The topic to read.
    pub topic: String,
    /// The consumer group; each group sees every message.
    pub group: String,
    /// How long a delivery stays invisible to others before redelivery.
    pub lease: Duration,
    /// Deletes the group once no member has read from it for this long
    /// (`None`, the default: never). A topic the broker created for such a
    /// subscription goes with its last group, messages and all. For
    /// topics only one process reads, such as request-reply's reply
    /// topics: when that process dies, nobody will ever read them.
    pub expire_after_idle: Option<Duration>,
}

impl SubscribeOptions {
    /// Options for `group` on `topic`, with a 30 s lease.
    pub fn new(topic: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            group: group.into(),
            lease: Duration::from_secs(30),
            expire_after_idle: None,
        }
    }

    /// Sets the lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets [`expire_after_idle`](Self::expire_after_idle).
    pub fn expire_after_idle(mut self, idle: Duration) -> Self {
        self.expire_after_idle = Some(idle);
        self
    }
}

/// One delivery of a message to a consumer, with the handle to settle it.
pub struct Delivery {
    /// The message.
    pub message: Message,
    /// How many times this message has been delivered to this group,
    /// this delivery included (1 the first time).
    pub delivery_count: u32,
    received_at: Option<DateTime<Utc>>,
    control: Box<dyn DeliveryControl>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("message", &self.message)
            .field("delivery_count", &self.delivery_count)
            .field("received_at", &self.received_at)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// A delivery settled through `control` (for broker implementations).
    pub fn new(message: Message, delivery_count: u32, control: Box<dyn DeliveryControl>) -> Self {
        Self {
            message,
            delivery_count,
            received_at: None,
            control,
        }
    }

    /// Records when the broker received the message (for broker
    /// implementations): what a consumer sees as the CloudEvents `time`.
    #[must_use]
    pub fn with_received_at(mut self, at: DateTime<Utc>) -> Self {
        self.received_at = Some(at);
        self
    }

    /// When the broker received the message, if it says: the CloudEvents
    /// `time` ("when the broker got it"), as opposed to `occurredAt`, when
    /// the fact happened. A replayed dead letter was received again when it
    /// was replayed.
    pub fn received_at(&self) -> Option<DateTime<Utc>> {
        self.received_at
    }

    /// Done: never deliver this message to this group again. Call only after
    /// the effect committed.
    pub async fn ack(&self) -> Result<(), BrokerError> {
        self.control.ack().await
    }

    /// Not done: deliver it again after `delay`.
    pub async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.control.nack(delay).await
    }

    /// Still working: keep it invisible to others for `lease` from now.
    pub async fn extend_lease(&self, lease: Duration) -> Result<(), BrokerError> {
        self.control.extend(lease).await
    }

    /// Give up for good (it was dead-lettered): never deliver it again.
    pub async fn terminate(&self) -> Result<(), BrokerError> {
        self.control.terminate().await
    }
}

/// How long a broker keeps what it stored; see [`Broker::retention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageRetention {
    /// Messages are kept this long after they were stored.
    For(Duration),
    /// Messages are kept until removed by hand (no age limit).
    Forever,
    /// The broker does not say.
    Unknown,
}

/// Where a consumer group created after messages were published starts
/// reading; see [`Broker::group_start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GroupStart {
    /// At the oldest message the topic retains: the topic is a log that
    /// groups read at their own pace (the embedded broker, JetStream,
    /// Kafka). A late group catches up on history.
    OldestRetained,
    /// At its creation: each group is a queue of its own that a publish
    /// fills, so a message published while a group did not exist never
    /// reaches it (RabbitMQ). Subscribe, or declare, every group before its
    /// topic's first publish.
    Creation,
}

/// How a broker settles one delivery. Implemented by brokers, used through
/// [`Delivery`].
#[async_trait]
pub trait DeliveryControl: Send + Sync {
    /// See [`Delivery::ack`].
    async fn ack(&self) -> Result<(), BrokerError>;
    /// See [`Delivery::nack`].
    async fn nack(&self, delay: Duration) -> Result<(), BrokerError>;
    /// See [`Delivery::extend_lease`].
    async fn extend(&self, lease: Duration) -> Result<(), BrokerError>;
    /// See [`Delivery::terminate`].
    async fn terminate(&self) -> Result<(), BrokerError>;
}

/// A durable message broker.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// Publishes messages in order. Returns once the broker has durably
    /// accepted all of them; a message id already seen on its topic is
    /// accepted and dropped.
    ///
    /// A message the broker can never accept is [`BrokerError::Invalid`],
    /// and no message *after* it in `messages` may have been stored (the
    /// ones before it may have been): the outbox relay then republishes the
    /// batch row by row, parks the refused row and holds back its key, so a
    /// later message of that key never overtakes it.
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError>;

    /// Whether this broker could ever accept `message`: the checks
    /// [`publish`](Self::publish) makes before sending anything (names,
    /// keys and headers it can carry, its size limit), without I/O.
    /// [`BrokerError::Invalid`] says what is wrong. The outbox asks at
    /// append time, so an event that could never leave is refused in the
    /// business transaction instead of being parked later. The default
    /// accepts everything.
    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        let _ = message;
        Ok(())
    }

    /// How long the broker keeps a message it stored, whether or not its
    /// groups settled it: what a late group or a replay from the start can
    /// still read. [`MessageRetention::Forever`] when nothing but the
    /// groups' acks removes messages; the default says
    /// [`MessageRetention::Unknown`]. What refers to a message from outside
    /// the broker (a claim-checked payload) must live at least this long.
    fn retention(&self) -> MessageRetention {
        MessageRetention::Unknown
    }

    /// Where a group created after messages were published starts reading.
    /// The default is [`GroupStart::OldestRetained`].
    fn group_start(&self) -> GroupStart {
        GroupStart::OldestRetained
    }

    /// Creates a consumer group without reading from it, so that what is
    /// published from now on waits for it: what a deployment does for its
    /// groups before its producers start, where groups start at their
    /// creation ([`GroupStart::Creation`]). Declaring an existing group
    /// changes nothing. The default (groups that read the topic's history)
    /// does nothing.
    async fn declare_group(&self, options: &SubscribeOptions) -> Result<(), BrokerError> {
        let _ = options;
        Ok(())
    }

    /// Opens (creating if needed) a consumer group's subscription.
    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError>;

    /// A cheap liveness check for `/debug/deep`.
    async fn ping(&self) -> Result<(), BrokerError> {
        Ok(())
    }

    /// Deletes the groups subscribed with
    /// [`expire_after_idle`](SubscribeOptions::expire_after_idle) that no
    /// member read for that long, and the topics created for them that have
    /// no group left. Returns how many topics and groups it deleted. Safe to
    /// call from every process at once; brokers whose server expires groups
    /// itself only remove what the server leaves behind. The default
    /// (a broker without expiring groups) deletes nothing.
    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        Ok(0)
    }

    /// Deletes `group` of `topic` now, with its unsettled messages, and the
    /// topic too when it was created for expiring groups and none is left:
    /// what a process does on a clean shutdown with a group nobody else
    /// reads. Deleting a group that does not exist is not an error.
    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        let _ = (topic, group);
        Ok(())
    }

    /// How many messages of `topic` the consumer group `group` has not
    /// finished yet (consumer lag), as the broker counts them. `Ok(None)`
    /// when the group does not exist yet or the broker cannot tell (the
    /// default).
    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        let _ = (topic, group);
        Ok(None)
    }
}

/// A consumer group's unfinished messages on a topic: its lag.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Messages not handed to any member right now: never delivered,
    /// nacked, or back after a lost lease.
    pub waiting: u64,
    /// Messages delivered to a member (or held for one) and not settled.
    pub in_flight: u64,
}

impl Backlog {
    /// Every unfinished message: waiting plus in flight.
    pub fn total(&self) -> u64 {
        self.waiting + self.in_flight
    }
}

/// A consumer group's view of a topic.
#[async_trait]
pub trait Subscription: Send {
    /// Up to `max` deliveries, waiting up to `wait` for the first one.
    /// Returns an empty batch when nothing arrived in time.
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError>;
}

/// A broker operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker could not be reached or is restarting; try again.
    #[error("broker unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// A publish may or may not have been stored (a timeout waiting for the
    /// ack). Republishing is safe: the message id dedupes it.
    #[error("broker outcome unknown: {0}")]
    OutcomeUnknown(#[source] BoxError),
    /// The delivery's lease expired and someone else may hold it now; the
    /// settle had no effect.
    #[error("the lease on this delivery expired; it will be redelivered")]
    LeaseLost,
    /// A message or option the broker refuses (too large, bad topic name).
    #[error("broker refused the request: {0}")]
    Invalid(String),
    /// Anything else.
    #[error("broker error: {0}")]
    Other(#[source] BoxError),
}

impl Classify for BrokerError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Unavailable(_) => ErrorClass::Retryable,
            Self::OutcomeUnknown(_) => ErrorClass::OutcomeUnknown,
            Self::LeaseLost | Self::Invalid(_) => ErrorClass::Permanent,
            // Nobody said what kind of failure it is: it counts against the
            // dependency (breakers) and is not retried.
            Self::Other(_) => ErrorClass::Unclassified,
        }
    }
}
