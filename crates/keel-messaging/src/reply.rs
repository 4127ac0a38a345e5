//! Request-reply over the broker: a [`Requester`] that never leaks a waiting
//! call, and a [`Responder`] that follows the three rules.
//!
//! Sometimes a service needs an answer from another one and still wants the
//! broker between them (buffering, load levelling, no service discovery).
//! The requester's half:
//!
//! - **One reply topic per process** (`_reply.<uuid>`), read by this process
//!   only, so a reply always reaches the process holding the waiting call.
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
//! The responder's half, three rules (seed 000):
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

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use keel_core::clock::{self, Instant};
use keel_core::deadline::MIN_TIME_TO_START;
use keel_core::{BoxError, Classify, Deadline, ErrorClass};
pub use keel_policy::retry::Backoff;
use parking_lot::Mutex;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;

use crate::broker::{
    Broker, BrokerError, Delivery, Headers, Message, SubscribeOptions, Subscription, header,
};
use crate::store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, StoreError};

/// The header carrying the request id the responder dedupes on; stable
/// across a caller's retries of one request.
pub const REQUEST_ID: &str = "request-id";

/// The header saying whether a reply is a result (`ok`) or a refusal
/// (`error`, with the reason as the payload).
pub const REPLY_STATUS: &str = "reply-status";

/// The default time a requester waits for a reply (seed 000: 2 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a responder remembers a reply for repeats of its request.
pub const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(600);

/// How many replies a responder remembers at most.
pub const DEFAULT_REPLY_CAPACITY: usize = 10_000;

/// The prefix of per-process reply topics.
pub const REPLY_TOPIC_PREFIX: &str = "_reply.";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

// ---------------------------------------------------------------------------
// Requester
// ---------------------------------------------------------------------------

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
    /// never beyond the current task's [`Deadline`].
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The body.
    pub payload: Bytes,
    /// The reply's headers.
    pub headers: Headers,
}

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

type Pending = Mutex<HashMap<String, oneshot::Sender<Reply>>>;

struct RequesterShared {
    broker: Arc<dyn Broker>,
    reply_topic: String,
    default_timeout: Duration,
    pending: Pending,
    listening: AtomicBool,
}

/// Sends requests and waits for their replies. A cheap handle: clone it
/// freely; every clone shares the process's reply topic.
#[derive(Clone)]
pub struct Requester {
    shared: Arc<RequesterShared>,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester")
            .field("reply_topic", &self.shared.reply_topic)
            .field("pending", &self.pending())
            .finish_non_exhaustive()
    }
}

/// Builds a [`Requester`] and its [`ReplyListener`].
pub struct RequesterBuilder {
    broker: Arc<dyn Broker>,
    reply_topic: Option<String>,
    default_timeout: Duration,
    lease: Duration,
    poll_wait: Duration,
    batch: usize,
}

impl std::fmt::Debug for RequesterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequesterBuilder")
            .field("reply_topic", &self.reply_topic)
            .field("default_timeout", &self.default_timeout)
            .finish_non_exhaustive()
    }
}

impl RequesterBuilder {
    /// Replies go to `topic` instead of a fresh `_reply.<uuid>`. It must be
    /// read by this process only.
    pub fn reply_topic(mut self, topic: impl Into<String>) -> Self {
        self.reply_topic = Some(topic.into());
        self
    }

    /// How long calls wait by default (2 s).
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = timeout;
        self
    }

    /// How long the listener waits in one receive before checking for
    /// shutdown (default 250 ms).
    pub fn poll_wait(mut self, wait: Duration) -> Self {
        self.poll_wait = wait;
        self
    }

    /// Subscribes to the reply topic. Run the returned listener (e.g. in a
    /// spawned task) for replies to arrive.
    pub async fn build(self) -> Result<ReplyListener, BrokerError> {
        let reply_topic = self
            .reply_topic
            .unwrap_or_else(|| format!("{REPLY_TOPIC_PREFIX}{}", keel_core::id::new_id()));
        let options =
            SubscribeOptions::new(reply_topic.clone(), reply_topic.clone()).lease(self.lease);
        let subscription = self.broker.subscribe(options).await?;
        tracing::info!(%reply_topic, "request-reply: listening for replies");
        Ok(ReplyListener {
            requester: Requester {
                shared: Arc::new(RequesterShared {
                    broker: self.broker,
                    reply_topic,
                    default_timeout: self.default_timeout,
                    pending: Mutex::new(HashMap::new()),
                    // Replies wait in the broker until `run` reads them.
                    listening: AtomicBool::new(true),
                }),
            },
            subscription,
            poll_wait: self.poll_wait,
            batch: self.batch,
        })
    }
}

/// Removes a pending entry however the call ends: reply, timeout, error or
/// the caller dropping the future.
struct PendingGuard<'a> {
    pending: &'a Pending,
    correlation_id: String,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.pending.lock().remove(&self.correlation_id);
    }
}

impl Requester {
    /// A builder over `broker`.
    pub fn builder(broker: Arc<dyn Broker>) -> RequesterBuilder {
        RequesterBuilder {
            broker,
            reply_topic: None,
            default_timeout: DEFAULT_TIMEOUT,
            lease: Duration::from_secs(30),
            poll_wait: Duration::from_millis(250),
            batch: 64,
        }
    }

    /// This process's reply topic.
    pub fn reply_topic(&self) -> &str {
        &self.shared.reply_topic
    }

    /// How many calls are waiting for a reply now (for metrics, and to
    /// check that none leak).
    pub fn pending(&self) -> usize {
        self.shared.pending.lock().len()
    }

    /// Sends `request` and waits for its reply, until the request's timeout
    /// or the current task's deadline, whichever is first.
    pub async fn call(&self, request: Request) -> Result<Reply, RequestError> {
        if !self.shared.listening.load(Ordering::Acquire) {
            return Err(RequestError::NotListening);
        }
        let timeout = request.timeout.unwrap_or(self.shared.default_timeout);
        let deadline = Deadline::after(timeout).min_with(Deadline::current());
        let topic = request.topic.clone();
        if deadline.too_late_to_start(MIN_TIME_TO_START) {
            return Err(RequestError::DeadlineExceeded { topic });
        }
        let correlation_id = keel_core::id::new_id().to_string();
        let request_id = request
            .request_id
            .clone()
            .unwrap_or_else(|| correlation_id.clone());
        let (tx, rx) = oneshot::channel();
        self.shared
            .pending
            .lock()
            .insert(correlation_id.clone(), tx);
        let _guard = PendingGuard {
            pending: &self.shared.pending,
            correlation_id: correlation_id.clone(),
        };
        let message = self.request_message(request, &correlation_id, &request_id, deadline);
        let started = clock::now();
        self.shared
            .broker
            .publish(&[message])
            .await
            .map_err(|source| RequestError::Publish {
                topic: topic.clone(),
                source,
            })?;
        metrics::counter!("keel_reply_requests_total").increment(1);
        match tokio::time::timeout_at(deadline.instant(), rx).await {
            Ok(Ok(reply)) => {
                metrics::histogram!("keel_reply_latency_seconds")
                    .record(started.elapsed().as_secs_f64());
                reply_result(&topic, reply)
            }
            Ok(Err(_closed)) => Err(RequestError::NotListening),
            Err(_elapsed) => {
                metrics::counter!("keel_reply_timeouts_total").increment(1);
                tracing::debug!(%topic, %request_id, %correlation_id, "request timed out");
                Err(RequestError::Timeout {
                    topic,
                    request_id,
                    after: started.elapsed(),
                })
            }
        }
    }

    fn request_message(
        &self,
        request: Request,
        correlation_id: &str,
        request_id: &str,
        deadline: Deadline,
    ) -> Message {
        let key = request.key.unwrap_or_else(|| request_id.to_owned());
        let mut message = Message::new(correlation_id, request.topic, key, request.payload);
        message.headers.extend(request.headers);
        message
            .with_header(header::REPLY_TO, self.shared.reply_topic.clone())
            .with_header(header::CORRELATION_ID, correlation_id)
            .with_header(header::DEADLINE, deadline.to_header_value())
            .with_header(REQUEST_ID, request_id)
    }

    fn dispatch(&self, message: Message) {
        let Some(correlation_id) = message.header(header::CORRELATION_ID) else {
            tracing::warn!(id = %message.id, "reply without a correlation id discarded");
            return;
        };
        let waiting = self.shared.pending.lock().remove(correlation_id);
        match waiting {
            Some(tx) => {
                let _ = tx.send(Reply {
                    payload: message.payload,
                    headers: message.headers,
                });
            }
            None => {
                // We already gave up on this request. The work may still
                // have happened - which is why requests must be idempotent.
                metrics::counter!("keel_reply_late_total").increment(1);
                tracing::info!(%correlation_id, "late reply discarded");
            }
        }
    }
}

fn reply_result(topic: &str, reply: Reply) -> Result<Reply, RequestError> {
    if reply.headers.get(REPLY_STATUS).map(String::as_str) == Some(STATUS_ERROR) {
        return Err(RequestError::Refused {
            topic: topic.to_owned(),
            reason: String::from_utf8_lossy(&reply.payload).into_owned(),
        });
    }
    Ok(reply)
}

/// Reads this process's reply topic and hands each reply to its waiting
/// call. Run it for as long as the [`Requester`] is used.
pub struct ReplyListener {
    requester: Requester,
    subscription: Box<dyn Subscription>,
    poll_wait: Duration,
    batch: usize,
}

impl std::fmt::Debug for ReplyListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyListener")
            .field("requester", &self.requester)
            .finish_non_exhaustive()
    }
}

impl ReplyListener {
    /// A handle to send requests with.
    pub fn requester(&self) -> Requester {
        self.requester.clone()
    }

    /// Dispatches replies until `shutdown` completes. Calls still waiting
    /// then fail with [`RequestError::NotListening`], as do later calls.
    pub async fn run(mut self, shutdown: impl Future<Output = ()> + Send) {
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let received = tokio::select! {
                () = &mut shutdown => break,
                received = self.subscription.receive(self.batch, self.poll_wait) => received,
            };
            match received {
                Ok(deliveries) => {
                    failures = 0;
                    for delivery in deliveries {
                        // Replies are consumed at most once: ack, then hand over.
                        if let Err(e) = delivery.ack().await {
                            tracing::debug!(error = %e, "could not ack a reply");
                        }
                        self.requester.dispatch(delivery.message);
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let delay = Backoff::default()
                        .delay(failures.min(16))
                        .unwrap_or_default();
                    tracing::warn!(error = %e, ?delay, "reply listener: receive failed");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        tracing::info!(reply_topic = %self.requester.reply_topic(), "reply listener stopped");
    }
}

impl Drop for ReplyListener {
    fn drop(&mut self) {
        let shared = &self.requester.shared;
        shared.listening.store(false, Ordering::Release);
        // Wake every waiting call: no reply can reach it now.
        shared.pending.lock().clear();
    }
}

// ---------------------------------------------------------------------------
// Responder
// ---------------------------------------------------------------------------

const STATUS_OK: &str = "ok";
const STATUS_ERROR: &str = "error";

/// A request as the responder's handler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingRequest {
    /// The request message.
    pub message: Message,
    /// The id to be idempotent on (stable across the caller's retries).
    pub request_id: String,
    /// When the requester stops waiting; the handler runs within it.
    pub deadline: Option<Deadline>,
    /// How many times this message has been delivered (1 the first time).
    pub delivery_count: u32,
}

impl IncomingRequest {
    /// The request body.
    pub fn payload(&self) -> &Bytes {
        &self.message.payload
    }
}

/// Computes a reply to a request. Return an error classified
/// [`Retryable`](ErrorClass::Retryable) (or of unknown outcome, or a
/// policy's refusal) to have the request redelivered after a backoff; any
/// other error is sent back to the requester as a refusal
/// ([`RequestError::Refused`]).
#[async_trait]
pub trait RequestHandler: Send + Sync + 'static {
    /// The reply body for `request`.
    async fn handle(&self, request: IncomingRequest) -> Result<Bytes, BoxError>;
}

#[async_trait]
impl<F, Fut, E> RequestHandler for F
where
    F: Fn(IncomingRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
    E: Into<BoxError>,
{
    async fn handle(&self, request: IncomingRequest) -> Result<Bytes, BoxError> {
        (self)(request).await.map_err(Into::into)
    }
}

/// What a [`Responder`] did with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// The handler ran; its reply (or refusal) was published, then the
    /// request acked.
    Replied,
    /// A repeat of a request already answered: the stored reply was
    /// published again, the handler did not run.
    Resent,
    /// The deadline had passed (before or during the work): dropped, no
    /// reply (nobody is waiting).
    Expired,
    /// A transient failure: the request will be redelivered.
    Retrying,
    /// Malformed (no reply-to or correlation id, or a bad deadline):
    /// dead-lettered if a store was configured, never redelivered.
    Rejected(String),
}

type DeadLetterFn = Arc<dyn Fn(DeadLetter) -> BoxFuture<Result<(), StoreError>> + Send + Sync>;

/// Builds a [`Responder`].
pub struct ResponderBuilder {
    broker: Arc<dyn Broker>,
    options: SubscribeOptions,
    cache_ttl: Duration,
    cache_capacity: usize,
    backoff: Backoff,
    max_deliveries: u32,
    concurrency: usize,
    poll_wait: Duration,
    dead_letters: Option<DeadLetterFn>,
}

impl std::fmt::Debug for ResponderBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponderBuilder")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl ResponderBuilder {
    /// How long replies are remembered for repeats (default 10 minutes).
    pub fn reply_ttl(mut self, ttl: Duration) -> Self {
        self.cache_ttl = ttl;
        self
    }

    /// How many replies are remembered at most (default 10 000).
    pub fn reply_capacity(mut self, capacity: usize) -> Self {
        self.cache_capacity = capacity.max(1);
        self
    }

    /// The redelivery delays after transient failures (default: 200 ms
    /// doubling to 10 s, full jitter).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// After this many deliveries failing transiently, the requester gets a
    /// refusal (default 5).
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// How many requests are handled at once (default 16).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Malformed requests go to this dead-letter store, with the reason.
    pub fn dead_letters<S: DeadLetterStore>(mut self, store: S) -> Self {
        self.dead_letters = Some(Arc::new(move |letter: DeadLetter| {
            let store = store.clone();
            Box::pin(async move { store.dead_letter_put(&letter).await })
        }));
        self
    }

    /// The responder, answering with `handler`.
    pub fn build<H: RequestHandler>(self, handler: H) -> Responder<H> {
        Responder {
            inner: Arc::new(ResponderInner {
                broker: self.broker,
                options: self.options,
                handler,
                replies: ReplyCache::new(self.cache_ttl, self.cache_capacity),
                backoff: self.backoff,
                max_deliveries: self.max_deliveries,
                concurrency: self.concurrency,
                poll_wait: self.poll_wait,
                dead_letters: self.dead_letters,
            }),
        }
    }
}

struct ResponderInner<H> {
    broker: Arc<dyn Broker>,
    options: SubscribeOptions,
    handler: H,
    replies: ReplyCache,
    backoff: Backoff,
    max_deliveries: u32,
    concurrency: usize,
    poll_wait: Duration,
    dead_letters: Option<DeadLetterFn>,
}

/// Answers requests on a topic: reply first, ack after, once per request id.
/// Cheap to clone.
pub struct Responder<H> {
    inner: Arc<ResponderInner<H>>,
}

impl<H> Clone for Responder<H> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<H> std::fmt::Debug for Responder<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// Why a request cannot be answered at all.
struct Malformed(String);

/// Where to send the reply, read from the request's headers.
struct ReturnAddress {
    reply_to: String,
    correlation_id: String,
    request_id: String,
    deadline: Option<Deadline>,
}

impl Responder<()> {
    /// A builder for a responder reading `options.topic` as `options.group`.
    pub fn builder(broker: Arc<dyn Broker>, options: SubscribeOptions) -> ResponderBuilder {
        ResponderBuilder {
            broker,
            options,
            cache_ttl: DEFAULT_REPLY_TTL,
            cache_capacity: DEFAULT_REPLY_CAPACITY,
            backoff: Backoff::default(),
            max_deliveries: 5,
            concurrency: 16,
            poll_wait: Duration::from_millis(250),
            dead_letters: None,
        }
    }
}

impl<H: RequestHandler> Responder<H> {
    /// Subscribes and answers requests until `shutdown` completes, then
    /// finishes the requests in hand.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), BrokerError> {
        let inner = &self.inner;
        let mut subscription = inner.broker.subscribe(inner.options.clone()).await?;
        let permits = Arc::new(Semaphore::new(inner.concurrency));
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            while tasks.try_join_next().is_some() {}
            let free = permits.available_permits().max(1);
            let received = tokio::select! {
                () = &mut shutdown => break,
                received = subscription.receive(free, inner.poll_wait) => received,
            };
            let deliveries = match received {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(topic = %inner.options.topic, error = %e, "responder: receive failed");
                    tokio::time::sleep(inner.poll_wait).await;
                    continue;
                }
            };
            for delivery in deliveries {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    break;
                };
                let this = self.clone();
                tasks.spawn(async move {
                    let _permit = permit;
                    if let Err(e) = this.handle(&delivery).await {
                        tracing::warn!(error = %e, "responder: could not settle a request");
                    }
                });
            }
        }
        while tasks.join_next().await.is_some() {}
        Ok(())
    }

    /// Handles one delivery by the three rules; returns what it did. An
    /// error means the request could not be settled and will be redelivered.
    pub async fn handle(&self, delivery: &Delivery) -> Result<Handled, BrokerError> {
        let address = match return_address(&delivery.message) {
            Ok(a) => a,
            Err(Malformed(reason)) => return self.reject(delivery, reason).await,
        };
        if address.deadline.is_some_and(|d| d.is_expired()) {
            return self.expire(delivery, &address).await;
        }
        if let Some(stored) = self.inner.replies.get(&address.request_id) {
            metrics::counter!("keel_reply_deduplicated_total").increment(1);
            tracing::info!(request_id = %address.request_id, "repeat request: stored reply sent again");
            self.publish_then_ack(delivery, &address, &stored).await?;
            return Ok(Handled::Resent);
        }
        let request = IncomingRequest {
            message: delivery.message.clone(),
            request_id: address.request_id.clone(),
            deadline: address.deadline,
            delivery_count: delivery.delivery_count,
        };
        let outcome = match address.deadline {
            Some(deadline) => {
                let work = deadline.scope(self.inner.handler.handle(request));
                match tokio::time::timeout_at(deadline.instant(), work).await {
                    Ok(outcome) => outcome,
                    Err(_) => return self.expire(delivery, &address).await,
                }
            }
            None => self.inner.handler.handle(request).await,
        };
        let reply = match outcome {
            Ok(body) => StoredReply {
                status: STATUS_OK,
                payload: body,
            },
            Err(err) => match self.failed(delivery, &address, &err).await? {
                Some(refusal) => refusal,
                None => return Ok(Handled::Retrying),
            },
        };
        // Rule 3: remember the reply before publishing, so a redelivery after
        // a failed publish or ack does not redo the work.
        self.inner
            .replies
            .insert(&address.request_id, reply.clone());
        // Rules 1 and 2: publish, then ack.
        self.publish_then_ack(delivery, &address, &reply).await?;
        Ok(Handled::Replied)
    }

    /// A handler error: a refusal to send back, or `None` after arranging a
    /// redelivery.
    async fn failed(
        &self,
        delivery: &Delivery,
        address: &ReturnAddress,
        err: &BoxError,
    ) -> Result<Option<StoredReply>, BrokerError> {
        let class = keel_core::error::classify(err.as_ref());
        let transient = matches!(
            class,
            ErrorClass::Retryable | ErrorClass::OutcomeUnknown | ErrorClass::Rejected
        );
        let report = keel_core::error::report(err.as_ref());
        if transient && delivery.delivery_count < self.inner.max_deliveries {
            let delay = self
                .inner
                .backoff
                .delay(delivery.delivery_count.saturating_sub(1))
                .unwrap_or_else(|| self.inner.backoff.max_delay());
            tracing::info!(request_id = %address.request_id, error = %report, ?delay, "request failed; redelivering");
            metrics::counter!("keel_reply_retried_total").increment(1);
            delivery.nack(delay).await?;
            return Ok(None);
        }
        tracing::warn!(request_id = %address.request_id, error = %report, "request refused");
        metrics::counter!("keel_reply_refused_total").increment(1);
        Ok(Some(StoredReply {
            status: STATUS_ERROR,
            payload: Bytes::from(report),
        }))
    }

    async fn publish_then_ack(
        &self,
        delivery: &Delivery,
        address: &ReturnAddress,
        reply: &StoredReply,
    ) -> Result<(), BrokerError> {
        let message = Message::new(
            format!("reply:{}", address.correlation_id),
            address.reply_to.clone(),
            address.correlation_id.clone(),
            reply.payload.clone(),
        )
        .with_header(header::CORRELATION_ID, address.correlation_id.clone())
        .with_header(REQUEST_ID, address.request_id.clone())
        .with_header(REPLY_STATUS, reply.status);
        if let Err(e) = self.inner.broker.publish(&[message]).await {
            // Not acked: the request comes back, and the stored reply with it.
            let _ = delivery
                .nack(self.inner.backoff.delay(0).unwrap_or_default())
                .await;
            return Err(e);
        }
        // A crash here leaves the request unacked: it is redelivered and
        // answered again from the stored reply.
        #[cfg(feature = "failpoints")]
        if fail::eval("keel-reply-before-ack", |arg| {
            arg.is_none_or(|id| id == address.request_id)
        }) == Some(true)
        {
            return Err(BrokerError::Other("failpoint keel-reply-before-ack".into()));
        }
        delivery.ack().await?;
        metrics::counter!("keel_reply_replied_total", "status" => reply.status).increment(1);
        Ok(())
    }

    async fn expire(
        &self,
        delivery: &Delivery,
        address: &ReturnAddress,
    ) -> Result<Handled, BrokerError> {
        metrics::counter!("keel_reply_expired_total").increment(1);
        tracing::info!(request_id = %address.request_id, "request expired before it was answered: dropped");
        delivery.ack().await?;
        Ok(Handled::Expired)
    }

    async fn reject(&self, delivery: &Delivery, reason: String) -> Result<Handled, BrokerError> {
        metrics::counter!("keel_reply_rejected_total").increment(1);
        tracing::warn!(id = %delivery.message.id, %reason, "malformed request");
        if let Some(dead_letters) = &self.inner.dead_letters {
            let now = keel_core::clock::utc_now();
            let letter = DeadLetter {
                id: keel_core::id::new_id().to_string(),
                message: delivery.message.clone(),
                group: self.inner.options.group.clone(),
                error_kind: "malformed".to_owned(),
                attempts: vec![AttemptError {
                    attempt: delivery.delivery_count,
                    error: reason.clone(),
                    at: now,
                }],
                dead_at: now,
                status: DeadLetterStatus::Pending,
            };
            if let Err(e) = dead_letters(letter).await {
                // Keep it: better redelivered than lost.
                tracing::warn!(error = %e, "could not dead-letter a malformed request");
                delivery.nack(self.inner.backoff.max_delay()).await?;
                return Ok(Handled::Retrying);
            }
        }
        delivery.terminate().await?;
        Ok(Handled::Rejected(reason))
    }
}

fn return_address(message: &Message) -> Result<ReturnAddress, Malformed> {
    let reply_to = message
        .header(header::REPLY_TO)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| Malformed("the request has no `reply-to` header".to_owned()))?;
    let correlation_id = message
        .header(header::CORRELATION_ID)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| Malformed("the request has no `correlation-id` header".to_owned()))?;
    let deadline = message
        .header(header::DEADLINE)
        .map(Deadline::parse_header)
        .transpose()
        .map_err(|e| Malformed(e.to_string()))?;
    let request_id = message
        .header(REQUEST_ID)
        .filter(|s| !s.is_empty())
        .unwrap_or(&message.id);
    Ok(ReturnAddress {
        reply_to: reply_to.to_owned(),
        correlation_id: correlation_id.to_owned(),
        request_id: request_id.to_owned(),
        deadline,
    })
}

// ---------------------------------------------------------------------------
// Reply cache
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
struct StoredReply {
    status: &'static str,
    payload: Bytes,
}

/// Recent replies by request id, bounded by age and by count (oldest
/// evicted first), like [`DedupWindow`](crate::dedup::DedupWindow) but
/// keeping the reply so a repeat can be answered.
struct ReplyCache {
    ttl: Duration,
    capacity: usize,
    state: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    replies: HashMap<String, (Instant, StoredReply)>,
    order: VecDeque<(Instant, String)>,
}

impl ReplyCache {
    fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl,
            capacity: capacity.max(1),
            state: Mutex::new(CacheState::default()),
        }
    }

    fn get(&self, request_id: &str) -> Option<StoredReply> {
        let mut state = self.state.lock();
        self.evict(&mut state, clock::now());
        state.replies.get(request_id).map(|(_, r)| r.clone())
    }

    fn insert(&self, request_id: &str, reply: StoredReply) {
        let now = clock::now();
        let mut state = self.state.lock();
        if state
            .replies
            .insert(request_id.to_owned(), (now, reply))
            .is_none()
        {
            state.order.push_back((now, request_id.to_owned()));
        }
        self.evict(&mut state, now);
    }

    fn evict(&self, state: &mut CacheState, now: Instant) {
        while let Some((at, id)) = state.order.front() {
            let expired = now.saturating_duration_since(*at) >= self.ttl;
            if !expired && state.order.len() <= self.capacity {
                break;
            }
            let id = id.clone();
            state.order.pop_front();
            state.replies.remove(&id);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.lock().replies.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use tokio::sync::mpsc;

    use super::*;
    use crate::broker::DeliveryControl;

    /// One consumer per topic, redelivery on nack, and a log of publishes
    /// and acks so tests can check their order.
    #[derive(Default)]
    struct MemoryBroker {
        topics: Mutex<HashMap<String, Queue>>,
        log: Arc<Mutex<Vec<String>>>,
    }

    type Item = (Message, u32);

    struct Queue {
        tx: mpsc::UnboundedSender<Item>,
        rx: Option<mpsc::UnboundedReceiver<Item>>,
    }

    impl MemoryBroker {
        fn sender(&self, topic: &str) -> mpsc::UnboundedSender<Item> {
            let mut topics = self.topics.lock();
            topics
                .entry(topic.to_owned())
                .or_insert_with(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    Queue { tx, rx: Some(rx) }
                })
                .tx
                .clone()
        }

        fn log(&self) -> Vec<String> {
            self.log.lock().clone()
        }
    }

    #[async_trait]
    impl Broker for MemoryBroker {
        async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
            for m in messages {
                self.log.lock().push(format!("publish {}", m.topic));
                let _ = self.sender(&m.topic).send((m.clone(), 1));
            }
            Ok(())
        }

        async fn subscribe(
            &self,
            options: SubscribeOptions,
        ) -> Result<Box<dyn Subscription>, BrokerError> {
            let tx = self.sender(&options.topic);
            let rx = self
                .topics
                .lock()
                .get_mut(&options.topic)
                .and_then(|q| q.rx.take())
                .ok_or_else(|| BrokerError::Invalid("one subscriber per topic".into()))?;
            Ok(Box::new(MemorySubscription {
                tx,
                rx,
                log: self.log.clone(),
            }))
        }
    }

    struct MemorySubscription {
        tx: mpsc::UnboundedSender<Item>,
        rx: mpsc::UnboundedReceiver<Item>,
        log: Arc<Mutex<Vec<String>>>,
    }

    #[async_trait]
    impl Subscription for MemorySubscription {
        async fn receive(
            &mut self,
            max: usize,
            wait: Duration,
        ) -> Result<Vec<Delivery>, BrokerError> {
            let mut out = Vec::new();
            if let Ok(Some(first)) = tokio::time::timeout(wait, self.rx.recv()).await {
                out.push(first);
                while out.len() < max {
                    match self.rx.try_recv() {
                        Ok(item) => out.push(item),
                        Err(_) => break,
                    }
                }
            }
            Ok(out
                .into_iter()
                .map(|(message, count)| {
                    let control = MemoryControl {
                        tx: self.tx.clone(),
                        item: (message.clone(), count),
                        log: self.log.clone(),
                    };
                    Delivery::new(message, count, Box::new(control))
                })
                .collect())
        }
    }

    struct MemoryControl {
        tx: mpsc::UnboundedSender<Item>,
        item: Item,
        log: Arc<Mutex<Vec<String>>>,
    }

    #[async_trait]
    impl DeliveryControl for MemoryControl {
        async fn ack(&self) -> Result<(), BrokerError> {
            self.log.lock().push(format!("ack {}", self.item.0.topic));
            Ok(())
        }
        async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
            self.log.lock().push(format!("nack {}", self.item.0.topic));
            let tx = self.tx.clone();
            let (message, count) = self.item.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = tx.send((message, count + 1));
            });
            Ok(())
        }
        async fn extend(&self, _lease: Duration) -> Result<(), BrokerError> {
            Ok(())
        }
        async fn terminate(&self) -> Result<(), BrokerError> {
            self.log
                .lock()
                .push(format!("terminate {}", self.item.0.topic));
            Ok(())
        }
    }

    async fn requester(broker: &Arc<MemoryBroker>) -> Requester {
        let listener = Requester::builder(broker.clone())
            .reply_topic("_reply.test")
            .build()
            .await
            .unwrap();
        let requester = listener.requester();
        tokio::spawn(listener.run(std::future::pending()));
        requester
    }

    fn responder<H: RequestHandler>(broker: &Arc<MemoryBroker>, handler: H) -> Responder<H> {
        let responder =
            Responder::builder(broker.clone(), SubscribeOptions::new("quote", "pricing"))
                .backoff(
                    Backoff::exponential(
                        Duration::from_millis(10),
                        2.0,
                        Duration::from_millis(100),
                    )
                    .unwrap(),
                )
                .build(handler);
        tokio::spawn(responder.clone().run(std::future::pending()));
        responder
    }

    fn counting(calls: Arc<AtomicU32>) -> impl RequestHandler {
        move |req: IncomingRequest| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                Ok::<_, BoxError>(Bytes::from(format!(
                    "{}#{n}",
                    String::from_utf8_lossy(req.payload())
                )))
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_reaches_its_caller_and_the_request_is_acked_after_it() {
        let broker = Arc::new(MemoryBroker::default());
        let calls = Arc::new(AtomicU32::new(0));
        responder(&broker, counting(calls.clone()));
        let requester = requester(&broker).await;
        let reply = requester
            .call(Request::new("quote", "sku-1"))
            .await
            .unwrap();
        assert_eq!(reply.payload, Bytes::from("sku-1#1"));
        assert_eq!(requester.pending(), 0);
        let log = broker.log();
        let published = log.iter().position(|l| l == "publish _reply.test").unwrap();
        let acked = log.iter().position(|l| l == "ack quote").unwrap();
        assert!(
            published < acked,
            "reply published before the request is acked: {log:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_repeated_request_gets_the_first_reply_without_redoing_work() {
        let broker = Arc::new(MemoryBroker::default());
        let calls = Arc::new(AtomicU32::new(0));
        responder(&broker, counting(calls.clone()));
        let requester = requester(&broker).await;
        let first = requester
            .call(Request::new("quote", "sku-1").request_id("req-7"))
            .await
            .unwrap();
        let again = requester
            .call(Request::new("quote", "sku-1").request_id("req-7"))
            .await
            .unwrap();
        assert_eq!(first.payload, again.payload);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    }

    #[tokio::test(start_paused = true)]
    async fn timeouts_and_cancellations_leave_no_pending_entry_and_late_replies_are_discarded() {
        let broker = Arc::new(MemoryBroker::default());
        let requester = requester(&broker).await;
        // Nobody answers: the call times out.
        let err = requester
            .call(Request::new("quote", "x").timeout(Duration::from_millis(300)))
            .await
            .unwrap_err();
        assert!(matches!(err, RequestError::Timeout { .. }), "{err}");
        assert_eq!(err.class(), ErrorClass::OutcomeUnknown);
        assert_eq!(requester.pending(), 0, "timed-out entry removed");

        // A caller that gives up (drops the future) removes its entry too.
        let call = requester.call(Request::new("quote", "y").timeout(Duration::from_secs(60)));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), call)
                .await
                .is_err()
        );
        assert_eq!(requester.pending(), 0, "cancelled entry removed");

        // The responder finally answers both: late replies, discarded.
        let mut requests = broker
            .subscribe(SubscribeOptions::new("quote", "late"))
            .await
            .unwrap();
        let late = requests
            .receive(10, Duration::from_millis(10))
            .await
            .unwrap();
        assert_eq!(late.len(), 2);
        for d in late {
            let corr = d.message.header(header::CORRELATION_ID).unwrap().to_owned();
            let reply = Message::new(format!("r-{corr}"), "_reply.test", corr.clone(), "late")
                .with_header(header::CORRELATION_ID, corr);
            broker.publish(&[reply]).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(requester.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_requests_are_dropped_without_running_the_handler() {
        let broker = Arc::new(MemoryBroker::default());
        let calls = Arc::new(AtomicU32::new(0));
        let responder = Responder::builder(broker.clone(), SubscribeOptions::new("quote", "p"))
            .build(counting(calls.clone()));
        let past = keel_core::clock::unix_millis() - 1_000;
        let request = Message::new("m-1", "quote", "k", "x")
            .with_header(header::REPLY_TO, "_reply.x")
            .with_header(header::CORRELATION_ID, "c-1")
            .with_header(header::DEADLINE, past.to_string());
        broker.publish(&[request]).await.unwrap();
        let mut sub = broker
            .subscribe(SubscribeOptions::new("quote", "p"))
            .await
            .unwrap();
        let d = sub
            .receive(1, Duration::from_millis(10))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(responder.handle(&d).await.unwrap(), Handled::Expired);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert!(broker.log().contains(&"ack quote".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn malformed_requests_are_rejected_not_redelivered() {
        let broker = Arc::new(MemoryBroker::default());
        let responder = Responder::builder(broker.clone(), SubscribeOptions::new("quote", "p"))
            .build(counting(Arc::new(AtomicU32::new(0))));
        broker
            .publish(&[Message::new("m-1", "quote", "k", "x")])
            .await
            .unwrap();
        let mut sub = broker
            .subscribe(SubscribeOptions::new("quote", "p"))
            .await
            .unwrap();
        let d = sub
            .receive(1, Duration::from_millis(10))
            .await
            .unwrap()
            .remove(0);
        let handled = responder.handle(&d).await.unwrap();
        assert!(
            matches!(handled, Handled::Rejected(ref r) if r.contains("reply-to")),
            "{handled:?}"
        );
        assert!(broker.log().contains(&"terminate quote".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_and_permanent_ones_refused() {
        let broker = Arc::new(MemoryBroker::default());
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        responder(&broker, move |req: IncomingRequest| {
            let c = c.clone();
            async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                match req.payload().as_ref() {
                    b"flaky" if n == 0 => Err(keel_core::Classified::retryable("busy").into()),
                    b"bad" => Err::<Bytes, BoxError>("no such sku".into()),
                    _ => Ok(Bytes::from_static(b"ok")),
                }
            }
        });
        let requester = requester(&broker).await;
        let reply = requester
            .call(Request::new("quote", "flaky"))
            .await
            .unwrap();
        assert_eq!(reply.payload, Bytes::from_static(b"ok"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let err = requester
            .call(Request::new("quote", "bad"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Refused { ref reason, .. } if reason.contains("no such sku")),
            "{err}"
        );
        assert_eq!(requester.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_fail_fast_once_the_listener_is_gone() {
        let broker = Arc::new(MemoryBroker::default());
        let listener = Requester::builder(broker.clone()).build().await.unwrap();
        let requester = listener.requester();
        assert!(requester.reply_topic().starts_with(REPLY_TOPIC_PREFIX));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(listener.run(async move {
            let _ = stopped.await;
        }));
        let waiting = tokio::spawn({
            let requester = requester.clone();
            async move {
                requester
                    .call(Request::new("quote", "x").timeout(Duration::from_secs(60)))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(requester.pending(), 1);
        stop.send(()).unwrap();
        task.await.unwrap();
        assert!(matches!(
            waiting.await.unwrap(),
            Err(RequestError::NotListening)
        ));
        assert!(matches!(
            requester.call(Request::new("quote", "x")).await,
            Err(RequestError::NotListening)
        ));
        assert_eq!(requester.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_reply_cache_is_bounded_by_count_and_age() {
        let cache = ReplyCache::new(Duration::from_secs(10), 2);
        let reply = |s: &'static str| StoredReply {
            status: STATUS_OK,
            payload: Bytes::from_static(s.as_bytes()),
        };
        cache.insert("a", reply("1"));
        cache.insert("b", reply("2"));
        cache.insert("c", reply("3"));
        assert_eq!(cache.len(), 2);
        assert!(cache.get("a").is_none(), "oldest evicted by count");
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(cache.get("c").is_none(), "evicted by age");
        assert_eq!(cache.len(), 0);
    }
}
