//! The answering side: run the handler once per request id, reply to the
//! return address, and answer repeats from the cache.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use keel_core::{BoxError, Deadline, ErrorClass};
use keel_policy::retry::Backoff;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::broker::{Broker, BrokerError, Delivery, Message, SubscribeOptions, header};
use crate::store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, StoreError};

use super::cache::{ReplyCache, StoredReply};
use super::*;

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
