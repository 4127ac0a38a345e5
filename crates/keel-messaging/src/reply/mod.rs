//! Request-reply over the broker: a [`Requester`] that never leaks a waiting
//! call, and a [`Responder`] that follows the three rules.
//!
//! Sometimes a service needs an answer from another one and still wants the
//! broker between them (buffering, load levelling, no service discovery).
//! The requester's half:
//!
//! - **One reply topic per process** (`_reply.<uuid>`), read by this process
//!   only, so a reply always reaches the process holding the waiting call.
//!   It cleans up after itself: the listener deletes it on a clean
//!   shutdown, and it is an expiring subscription
//!   ([`expire_after_idle`](crate::broker::SubscribeOptions::expire_after_idle)),
//!   so the topic of a process that crashed is deleted by the broker's
//!   sweep once nobody read it for [`DEFAULT_REPLY_TOPIC_EXPIRY`]. Every
//!   listener sweeps as it runs, so restarts never pile topics up.
//! - **A correlation id per request**, the key of a pending-call map. The
//!   entry is removed when the reply arrives *and* when the call times out
//!   or is cancelled (dropped), by a drop guard: a requester under timeouts
//!   never grows. A reply arriving after that is a *late reply*: discarded
//!   and logged (`keel_reply_late_total`). The work may still have happened,
//!   which is why requests must be idempotent.
//! - **The deadline travels as the message's expiry**
//!   (`x-request-deadline-unix-ms`): a request nobody waits for any more is
//!   not worth doing, and the responder drops it.
//! - **A request id** (`request-id`), stable across the caller's retries
//!   (a fresh correlation id and message id per attempt), is what the
//!   responder dedupes on.
//!
//! The responder's half, three rules:
//!
//! 1. publish the reply to the request's `reply-to` with its
//!    `correlation-id` copied over;
//! 2. ack the request only **after** the reply is published: acking first
//!    means a crash in between loses the reply and the requester waits for
//!    nothing;
//! 3. be idempotent on the request id: a requester that timed out will
//!    retry, and the first attempt may already have done the work. The
//!    [`Responder`] keeps recent replies (bounded by time and count) and
//!    answers a repeat with the stored reply instead of running the handler
//!    again. The memory is per process and best-effort, so handlers must
//!    still tolerate a rare repeat (after a restart, or on another
//!    instance).
//!
//! ```no_run
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use keel_messaging::broker::{Broker, SubscribeOptions};
//! use keel_messaging::reply::{IncomingRequest, Request, Requester, Responder};
//!
//! # async fn demo(broker: Arc<dyn Broker>) -> Result<(), Box<dyn std::error::Error>> {
//! // The responder: quote prices.
//! let responder = Responder::builder(broker.clone(), SubscribeOptions::new("pricing.quote", "pricing"))
//!     .build(|req: IncomingRequest| async move {
//!         Ok::<_, std::io::Error>(Bytes::from(format!("quote for {}", req.request_id)))
//!     });
//! tokio::spawn(responder.run(std::future::pending()));
//!
//! // The requester: one reply topic for this process.
//! let listener = Requester::builder(broker).build().await?;
//! let requester = listener.requester();
//! tokio::spawn(listener.run(std::future::pending()));
//! let reply = requester.call(Request::new("pricing.quote", "sku-1")).await?;
//! println!("{:?}", reply.payload);
//! # Ok(()) }
//! ```

mod cache;
mod requester;
mod responder;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use keel_core::{Classify, ErrorClass};
pub use keel_policy::retry::Backoff;

use crate::broker::{BrokerError, Headers};

pub use requester::{ReplyListener, Requester, RequesterBuilder};
pub use responder::{Handled, IncomingRequest, RequestHandler, Responder, ResponderBuilder};

pub use crate::broker::reply::{DEFAULT_TIMEOUT, REPLY_STATUS, REPLY_TOPIC_PREFIX, REQUEST_ID};
use crate::broker::reply::{STATUS_ERROR, STATUS_OK};

/// How long a responder remembers a reply for repeats of its request.
pub const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(600);

/// How many replies a responder remembers at most.
pub const DEFAULT_REPLY_CAPACITY: usize = 10_000;

/// How long a reply topic outlives a requester that died without a clean
/// shutdown.
pub const DEFAULT_REPLY_TOPIC_EXPIRY: Duration = Duration::from_secs(300);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The topic the responder reads.
    pub topic: String,
    /// The partition key (default: the request id).
    pub key: Option<String>,
    /// The body.
    pub payload: Bytes,
    /// Extra headers.
    pub headers: Headers,
    /// How long to wait for the reply (default: the requester's, 2 s),
    /// never beyond the current task's [`Deadline`](keel_core::Deadline).
    pub timeout: Option<Duration>,
    /// The idempotency key the responder dedupes on (default: a new UUIDv7).
    /// Reuse it when retrying the same request.
    pub request_id: Option<String>,
}

impl Request {
    /// A request to `topic` with `payload`.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
            timeout: None,
            request_id: None,
        }
    }

    /// Sets the partition key.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets how long to wait for the reply.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sets the request id (reuse it when retrying this request).
    pub fn request_id(mut self, id: impl Into<String>) -> Self {
        self.request_id = Some(id.into());
        self
    }
}

/// A reply received by a [`Requester`].
pub use keel_store::broker::reply::Reply;

/// A request got no usable reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// No reply arrived in time. The request may still be processed.
    #[error(
        "no reply from `{topic}` within {after:?}: the request may still be processed; retry \
         with the same request id `{request_id}` to get its reply without redoing the work"
    )]
    Timeout {
        /// The request topic.
        topic: String,
        /// The request id.
        request_id: String,
        /// How long we waited.
        after: Duration,
    },
    /// Too little time was left before the deadline to send the request.
    #[error("deadline exceeded: too little time is left to send a request to `{topic}`")]
    DeadlineExceeded {
        /// The request topic.
        topic: String,
    },
    /// The request could not be published.
    #[error("could not publish the request to `{topic}`: {source}")]
    Publish {
        /// The request topic.
        topic: String,
        /// The broker's error.
        #[source]
        source: BrokerError,
    },
    /// The responder refused the request for good.
    #[error("`{topic}` refused the request: {reason}")]
    Refused {
        /// The request topic.
        topic: String,
        /// The responder's reason.
        reason: String,
    },
    /// The [`ReplyListener`] is not running, so no reply could arrive.
    #[error(
        "the reply listener is not running: spawn ReplyListener::run before calling, and keep \
         it running while requests are in flight"
    )]
    NotListening,
}

impl Classify for RequestError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Timeout { .. } => ErrorClass::OutcomeUnknown,
            Self::DeadlineExceeded { .. } => ErrorClass::Rejected,
            Self::Publish { source, .. } => source.class(),
            Self::Refused { .. } | Self::NotListening => ErrorClass::Permanent,
        }
    }
}
