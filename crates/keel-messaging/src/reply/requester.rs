//! The calling side: send a request, wait for its reply on this
//! process's reply topic.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_core::Deadline;
use keel_core::clock::{self};
use keel_core::deadline::MIN_TIME_TO_START;
use keel_policy::retry::Backoff;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::broker::{Broker, BrokerError, Message, SubscribeOptions, Subscription, header};

use super::*;

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
    reply_topic_expiry: Duration,
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

    /// How long the reply topic outlives its listener when the process dies
    /// without a clean shutdown (default 5 minutes): the broker then deletes
    /// it, and every requester's listener sweeps such topics as it runs.
    /// Keep it longer than your longest request timeout, so that a reply
    /// still on its way never finds the topic gone.
    pub fn reply_topic_expiry(mut self, expiry: Duration) -> Self {
        self.reply_topic_expiry = expiry;
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
    ///
    /// Refuses a reply topic expiry not longer than the default timeout or
    /// than four listener polls.
    pub async fn build(self) -> Result<ReplyListener, BrokerError> {
        let expiry = self.reply_topic_expiry;
        if expiry <= self.default_timeout || expiry < self.poll_wait * 4 {
            return Err(BrokerError::Invalid(format!(
                "a reply topic expiry of {expiry:?} must exceed the default timeout \
                 ({:?}) and four listener polls ({:?})",
                self.default_timeout,
                self.poll_wait * 4
            )));
        }
        let reply_topic = self
            .reply_topic
            .unwrap_or_else(|| format!("{REPLY_TOPIC_PREFIX}{}", keel_core::id::new_id()));
        let options = SubscribeOptions::new(reply_topic.clone(), reply_topic.clone())
            .lease(self.lease)
            .expire_after_idle(expiry);
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
            sweep_every: expiry,
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
            reply_topic_expiry: DEFAULT_REPLY_TOPIC_EXPIRY,
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
    match reply.refusal() {
        Some(reason) => Err(RequestError::Refused {
            topic: topic.to_owned(),
            reason,
        }),
        None => Ok(reply),
    }
}

/// Reads this process's reply topic and hands each reply to its waiting
/// call. Run it for as long as the [`Requester`] is used.
pub struct ReplyListener {
    requester: Requester,
    subscription: Box<dyn Subscription>,
    poll_wait: Duration,
    batch: usize,
    sweep_every: Duration,
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

    /// Dispatches replies until `shutdown` completes, then deletes the reply
    /// topic. Calls still waiting then fail with
    /// [`RequestError::NotListening`], as do later calls. Meanwhile it
    /// sweeps the broker's expired topics (those of requesters that died
    /// without a clean shutdown) once per reply topic expiry, starting now.
    pub async fn run(mut self, shutdown: impl Future<Output = ()> + Send) {
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        let mut next_sweep = clock::now();
        loop {
            // Between receives, never racing one: a receive cancelled while
            // it commits would hide what it leased until the lease ends.
            if clock::now() >= next_sweep {
                sweep_expired(self.requester.shared.broker.as_ref()).await;
                next_sweep = clock::now() + self.sweep_every;
            }
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
        let topic = self.requester.reply_topic();
        if let Err(error) = self
            .requester
            .shared
            .broker
            .remove_group(topic, topic)
            .await
        {
            tracing::warn!(%error, reply_topic = %topic, "could not delete the reply topic; it expires");
        }
        tracing::info!(reply_topic = %topic, "reply listener stopped");
    }
}

async fn sweep_expired(broker: &dyn Broker) {
    match broker.sweep_expired().await {
        Ok(0) => {}
        Ok(swept) => tracing::info!(swept, "deleted expired reply topics and groups"),
        Err(error) => tracing::warn!(%error, "sweeping expired reply topics failed"),
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
