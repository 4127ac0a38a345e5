//! Request-reply over RabbitMQ's direct reply-to: [`RabbitRequester`].
//!
//! `keel_messaging::reply`'s requester works on every broker by reading a
//! reply topic of its own, which on RabbitMQ is a quorum queue per process:
//! a replicated disk write per reply, for an answer that is worthless once
//! its caller stopped waiting. RabbitMQ's *direct reply-to* skips the
//! queue: a request published on a channel that consumes the pseudo-queue
//! `amq.rabbitmq.reply-to` gets its `reply-to` rewritten to an address of
//! that channel, and a reply published to the address goes straight to it.
//!
//! The request itself still goes through the topic's durable group queues,
//! so it waits for a responder that is restarting, and any responder
//! answers it: `keel_messaging::reply::Responder` over a
//! [`RabbitBroker`] publishes its reply to the rewritten address (the
//! broker routes such replies through the default exchange), and so does
//! any AMQP RPC server, since `reply-to` and `correlation-id` travel as the
//! AMQP properties of those names. Keel's rules hold on top:
//!
//! - **The deadline travels**, as `x-request-deadline-unix-ms` and as the
//!   message's AMQP `expiration`: RabbitMQ drops (dead-letters, reason
//!   `expired`) a request nobody took before its caller stopped waiting,
//!   and the responder drops one whose deadline passed.
//! - **A correlation id per call**, the key of the waiting calls' map; the
//!   entry goes when the reply arrives and when the call times out or is
//!   dropped, so a requester under timeouts never grows. A late reply is
//!   discarded (`keel_reply_late_total`).
//! - **A request id** (`request-id`), stable across a caller's retries
//!   when it passes one, which the responder dedupes on.
//! - **No responder group is a typed refusal**: requests are published
//!   *mandatory*, so one that no group queue would keep comes back at once
//!   as [`ReplyError::NoResponders`] instead of a timeout.
//!
//! Replies are at most once: a requester whose connection drops loses the
//! replies on their way (its waiting calls fail with
//! [`ReplyError::Unavailable`] at once), and a call that times out may have
//! been answered. Requests must be idempotent, as with every request-reply.
//!
//! ```no_run
//! use bytes::Bytes;
//! use keel_rabbitmq::{RabbitBroker, RabbitBrokerOptions, RabbitRequester};
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let broker = RabbitBroker::connect(RabbitBrokerOptions::new("amqp://127.0.0.1:5672/%2f")).await?;
//! let requester = RabbitRequester::new(&broker);
//! let reply = requester.call("pricing.quote", Bytes::from("sku-1")).await?;
//! println!("{:?}", reply.payload);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use keel_core::Deadline;
use keel_store::broker::reply::{DEFAULT_TIMEOUT, REQUEST_ID, Reply, ReplyError, call_deadline};
use keel_store::broker::{BrokerError, Headers, Message, header};
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::Confirmation;
use lapin::types::FieldTable;
use lapin::{Channel, Consumer};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::broker::{Inner, RabbitBroker};
use crate::envelope;
use crate::error::Within;

/// The pseudo-queue a direct reply-to requester consumes, and the
/// `reply-to` it sends (RabbitMQ rewrites it to the channel's address).
pub const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// Calls waiting for a reply, each with the generation of the reply
/// channel it was sent on.
type Pending = Mutex<HashMap<String, (u64, oneshot::Sender<Reply>)>>;

/// Sends requests through a [`RabbitBroker`]'s topics and waits for their
/// replies on a direct reply-to channel. A cheap handle: clone it freely.
#[derive(Debug, Clone)]
pub struct RabbitRequester {
    shared: Arc<Shared>,
    timeout: Duration,
}

#[derive(Debug)]
struct Shared {
    broker: Arc<Inner>,
    pending: Pending,
    channel: tokio::sync::Mutex<Option<ReplyChannel>>,
    generations: AtomicU64,
}

/// The channel requests go out on and replies come back to.
#[derive(Debug)]
struct ReplyChannel {
    channel: Channel,
    /// Which channel a waiting call was sent on, so that the end of one
    /// fails only its own calls.
    generation: u64,
}

impl Drop for ReplyChannel {
    /// Closes the channel (a no-op when it already broke): its listener
    /// then sees its replies end, fails the calls still waiting on it and
    /// stops.
    fn drop(&mut self) {
        let channel = self.channel.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = channel.close(200, "requester dropped").await;
            });
        }
    }
}

/// Removes a waiting call's entry however the call ends.
struct PendingGuard<'a> {
    pending: &'a Pending,
    correlation_id: &'a str,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.pending.lock().remove(self.correlation_id);
    }
}

impl RabbitRequester {
    /// A requester over `broker`'s connection, with the default timeout
    /// (2 s). Its channel opens on the first call.
    pub fn new(broker: &RabbitBroker) -> Self {
        Self {
            shared: Arc::new(Shared {
                broker: broker.inner(),
                pending: Mutex::new(HashMap::new()),
                channel: tokio::sync::Mutex::new(None),
                generations: AtomicU64::new(0),
            }),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets the default timeout (still capped by the task's [`Deadline`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many calls wait for a reply now (for metrics, and to check that
    /// none leak).
    pub fn pending(&self) -> usize {
        self.shared.pending.lock().len()
    }

    /// Sends `payload` to `topic` and waits for the reply.
    pub async fn call(&self, topic: &str, payload: Bytes) -> Result<Reply, ReplyError> {
        self.call_with(topic, payload, &Headers::new(), None).await
    }

    /// Sends a request with extra headers (a `request-id` among them keeps
    /// the responder's dedupe across the caller's retries) and an optional
    /// timeout of its own (else the requester's), capped by the task's
    /// [`Deadline`].
    pub async fn call_with(
        &self,
        topic: &str,
        payload: Bytes,
        headers: &Headers,
        timeout: Option<Duration>,
    ) -> Result<Reply, ReplyError> {
        let (deadline, remaining) = call_deadline(timeout.unwrap_or(self.timeout))?;
        let correlation_id = keel_core::id::new_id().to_string();
        let request = request(topic, payload, headers, &correlation_id, deadline);
        self.shared
            .broker
            .validate(&request)
            .map_err(|error| ReplyError::Invalid(error.to_string()))?;
        let (tx, rx) = oneshot::channel();
        let _guard = PendingGuard {
            pending: &self.shared.pending,
            correlation_id: &correlation_id,
        };
        let sent = tokio::time::timeout_at(deadline.instant(), self.send(&request, tx)).await;
        sent.map_err(|_| ReplyError::Timeout(remaining))??;
        metrics::counter!("keel_reply_requests_total").increment(1);
        let reply = match tokio::time::timeout_at(deadline.instant(), rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_closed)) => {
                return Err(ReplyError::Unavailable(
                    "the reply channel closed before the reply came".into(),
                ));
            }
            Err(_elapsed) => {
                metrics::counter!("keel_reply_timeouts_total").increment(1);
                return Err(ReplyError::Timeout(remaining));
            }
        };
        reply.into_result()
    }

    /// Registers the call, publishes its request mandatory on the reply
    /// channel and waits for the confirm.
    async fn send(&self, request: &Message, tx: oneshot::Sender<Reply>) -> Result<(), ReplyError> {
        let mut slot = self.shared.channel.lock().await;
        let (channel, generation) = self
            .reply_channel(&mut slot, &request.topic)
            .await
            .map_err(|error| ReplyError::Unavailable(error.to_string()))?;
        self.shared
            .pending
            .lock()
            .insert(request.id.clone(), (generation, tx));
        let (exchange, routing_key) = self.shared.broker.route(request);
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let properties = envelope::properties(request, keel_core::clock::utc_now());
        let confirm = channel
            .basic_publish(
                &exchange,
                &routing_key,
                mandatory,
                &request.payload,
                properties,
            )
            .await
            .map_err(|error| ReplyError::Unavailable(error.to_string()))?;
        drop(slot);
        match confirm.await {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(_returned))) => {
                Err(ReplyError::NoResponders(request.topic.clone()))
            }
            Ok(Confirmation::Nack(_)) => Err(ReplyError::Unavailable(
                "RabbitMQ refused to store the request (nack)".into(),
            )),
            Ok(Confirmation::NotRequested) => Ok(()),
            Err(error) => Err(ReplyError::Unavailable(error.to_string())),
        }
    }

    /// The live reply channel, with `topic`'s exchange declared on it,
    /// opening a new one (and its listener) when there is none.
    async fn reply_channel(
        &self,
        slot: &mut Option<ReplyChannel>,
        topic: &str,
    ) -> Result<(Channel, u64), BrokerError> {
        if slot
            .as_ref()
            .is_none_or(|open| !open.channel.status().connected())
        {
            *slot = None;
            *slot = Some(self.open().await?);
        }
        let open = slot.as_ref().expect("opened above");
        self.shared
            .broker
            .ensure_topic(&open.channel, topic)
            .await?;
        Ok((open.channel.clone(), open.generation))
    }

    async fn open(&self) -> Result<ReplyChannel, BrokerError> {
        let channel = self.shared.broker.link.channel().await?;
        let no_ack = BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        };
        let replies = channel
            .basic_consume(DIRECT_REPLY_TO, "", no_ack, FieldTable::default())
            .within()
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .within()
            .await?;
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(listen(replies, Arc::downgrade(&self.shared), generation));
        Ok(ReplyChannel {
            channel,
            generation,
        })
    }
}

/// The request message: Keel's reply headers on the caller's.
fn request(
    topic: &str,
    payload: Bytes,
    headers: &Headers,
    correlation_id: &str,
    deadline: Deadline,
) -> Message {
    let request_id = headers
        .get(REQUEST_ID)
        .cloned()
        .unwrap_or_else(|| correlation_id.to_owned());
    let mut message = Message::new(correlation_id, topic, request_id.clone(), payload);
    message.headers.extend(headers.clone());
    message
        .with_header(header::REPLY_TO, DIRECT_REPLY_TO)
        .with_header(header::CORRELATION_ID, correlation_id)
        .with_header(header::DEADLINE, deadline.to_header_value())
        .with_header(REQUEST_ID, request_id)
}

/// Hands each reply of one reply channel to its waiting call; when the
/// channel ends, fails the calls still waiting on it.
async fn listen(mut replies: Consumer, shared: std::sync::Weak<Shared>, generation: u64) {
    while let Some(Ok(delivery)) = replies.next().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let arrived = envelope::arrived(&delivery.properties, delivery.data);
        let message = arrived.message;
        let waiting = message
            .header(header::CORRELATION_ID)
            .and_then(|id| shared.pending.lock().remove(id));
        match waiting {
            Some((_, tx)) => {
                let _ = tx.send(Reply {
                    payload: message.payload,
                    headers: message.headers,
                });
            }
            None => {
                metrics::counter!("keel_reply_late_total").increment(1);
                tracing::debug!(id = %message.id, "late or unknown reply discarded");
            }
        }
    }
    if let Some(shared) = shared.upgrade() {
        shared
            .pending
            .lock()
            .retain(|_, (sent_on, _)| *sent_on != generation);
    }
}
