//! Request-reply over core NATS: [`NatsRequester`] and [`NatsResponder`].
//!
//! Core NATS already has what `keel_messaging::reply` builds on top of a
//! broker: every request gets a unique reply inbox (the reply-to address)
//! on the requester's one multiplexed subscription, and a reply that comes
//! after the caller stopped waiting is dropped by the client. What this
//! module adds are Keel's rules:
//!
//! - **The deadline travels**: the requester sends the earlier of its
//!   timeout and the task's [`Deadline`] as `x-request-deadline-unix-ms`, and
//!   waits exactly that long; the responder runs the handler inside that
//!   deadline and drops a request whose deadline already passed (nobody is
//!   waiting for it).
//! - **A correlation id** (`correlation-id`) on every request, copied onto
//!   the reply, for logs and tracing across the hop.
//! - **A typed outcome**: [`ReplyError::Timeout`] when no reply came in
//!   time (the work may still happen: requests must be idempotent),
//!   [`ReplyError::NoResponders`] when nobody listens, and
//!   [`ReplyError::Refused`] when the handler failed (`reply-status: error`).
//!
//! Core NATS request-reply is *at most once*: nothing is stored, a request
//! sent while no responder runs is refused at once. When the request must
//! survive a responder restart, use `keel_messaging::reply` over a
//! [`NatsBroker`](crate::NatsBroker) instead (durable, deduped on the
//! request id, at a JetStream round trip per hop).
//!
//! ```no_run
//! use bytes::Bytes;
//! use keel_nats::{NatsRequester, NatsResponder};
//! # async fn demo(client: async_nats::Client) -> Result<(), keel_nats::ReplyError> {
//! let responder = NatsResponder::new(client.clone(), "pricing.quote").queue_group("pricing");
//! tokio::spawn(responder.run(
//!     |req| async move { Ok::<_, std::io::Error>(Bytes::from(format!("quote for {:?}", req.payload))) },
//!     std::future::pending(),
//! ));
//! let reply = NatsRequester::new(client).call("pricing.quote", Bytes::from("sku-1")).await?;
//! println!("{:?}", reply.payload);
//! # Ok(()) }
//! ```

use std::fmt::Display;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use async_nats::{Client, HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use futures_util::StreamExt;
use keel_core::Deadline;
use keel_store::broker::reply::{
    DEFAULT_TIMEOUT, REPLY_STATUS, STATUS_ERROR, STATUS_OK, call_deadline,
};
use keel_store::broker::{Headers, header};

pub use keel_store::broker::reply::ReplyError;

/// A reply as received.
pub type NatsReply = keel_store::broker::reply::Reply;

/// Sends requests and waits for their replies, never past the deadline.
#[derive(Debug, Clone)]
pub struct NatsRequester {
    client: Client,
    timeout: Duration,
}

impl NatsRequester {
    /// A requester on `client` with the default timeout (2 s).
    pub fn new(client: Client) -> Self {
        Self {
            client,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets the default timeout (still capped by the task's [`Deadline`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends `payload` to `subject` and waits for the reply.
    pub async fn call(&self, subject: &str, payload: Bytes) -> Result<NatsReply, ReplyError> {
        self.call_with(subject, payload, &Headers::new(), None)
            .await
    }

    /// Sends a request with extra headers and an optional timeout of its own
    /// (else the requester's), capped by the task's [`Deadline`].
    pub async fn call_with(
        &self,
        subject: &str,
        payload: Bytes,
        headers: &Headers,
        timeout: Option<Duration>,
    ) -> Result<NatsReply, ReplyError> {
        let (deadline, remaining) = call_deadline(timeout.unwrap_or(self.timeout))?;
        let mut map = to_header_map(headers)?;
        insert(&mut map, header::DEADLINE, &deadline.to_header_value())?;
        let correlation_id = keel_core::id::new_id().to_string();
        insert(&mut map, header::CORRELATION_ID, &correlation_id)?;
        let request = async_nats::client::Request::new()
            .payload(payload)
            .headers(map)
            .timeout(Some(remaining));
        let reply = self
            .client
            .send_request(subject.to_owned(), request)
            .await
            .map_err(|e| match e.kind() {
                RequestErrorKind::TimedOut => ReplyError::Timeout(remaining),
                RequestErrorKind::NoResponders => ReplyError::NoResponders(subject.to_owned()),
                RequestErrorKind::InvalidSubject => ReplyError::Invalid(e.to_string()),
                _ => ReplyError::Unavailable(e.to_string()),
            })?;
        NatsReply {
            payload: reply.payload,
            headers: from_header_map(reply.headers.as_ref()),
        }
        .into_result()
    }
}

/// A request as the responder's handler sees it.
#[derive(Debug, Clone)]
pub struct NatsRequest {
    /// The subject it was sent to.
    pub subject: String,
    /// The body.
    pub payload: Bytes,
    /// Its headers.
    pub headers: Headers,
    /// The requester's deadline, when it sent one. The handler also runs
    /// inside it ([`Deadline::current`]).
    pub deadline: Option<Deadline>,
}

/// Answers requests on a subject with a handler, inside each request's
/// deadline.
#[derive(Debug, Clone)]
pub struct NatsResponder {
    client: Client,
    subject: String,
    queue_group: Option<String>,
}

impl NatsResponder {
    /// A responder for `subject` on `client`.
    pub fn new(client: Client, subject: impl Into<String>) -> Self {
        Self {
            client,
            subject: subject.into(),
            queue_group: None,
        }
    }

    /// Shares the requests with every responder in `group` (one of them
    /// answers each request) instead of every responder answering.
    pub fn queue_group(mut self, group: impl Into<String>) -> Self {
        self.queue_group = Some(group.into());
        self
    }

    /// Answers requests until `shutdown` completes. Each request runs in its
    /// own task, bounded by its deadline; one past its deadline is dropped
    /// unanswered.
    pub async fn run<H, Fut, E>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ReplyError>
    where
        H: Fn(NatsRequest) -> Fut + Send + Sync + Clone + 'static,
        Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let subscribed = match &self.queue_group {
            Some(group) => {
                self.client
                    .queue_subscribe(self.subject.clone(), group.clone())
                    .await
            }
            None => self.client.subscribe(self.subject.clone()).await,
        };
        let mut requests = subscribed.map_err(|e| ReplyError::Unavailable(e.to_string()))?;
        // Make sure the server knows the subscription before callers rely on it.
        self.client
            .flush()
            .await
            .map_err(|e| ReplyError::Unavailable(e.to_string()))?;
        tokio::pin!(shutdown);
        loop {
            let message = tokio::select! {
                () = &mut shutdown => break,
                message = requests.next() => match message {
                    Some(message) => message,
                    None => break,
                },
            };
            let Some(reply_to) = message.reply.clone() else {
                continue;
            };
            let headers = from_header_map(message.headers.as_ref());
            let deadline = headers
                .get(header::DEADLINE)
                .and_then(|v| Deadline::parse_header(v).ok());
            if deadline.is_some_and(|d| d.is_expired()) {
                metrics::counter!("keel_reply_expired_total").increment(1);
                tracing::debug!(subject = %message.subject, "dropped a request past its deadline");
                continue;
            }
            let request = NatsRequest {
                subject: message.subject.to_string(),
                payload: message.payload,
                headers,
                deadline,
            };
            tokio::spawn(answer(
                self.client.clone(),
                reply_to,
                request,
                handler.clone(),
            ));
        }
        Ok(())
    }
}

async fn answer<H, Fut, E>(
    client: Client,
    reply_to: async_nats::Subject,
    request: NatsRequest,
    handler: H,
) where
    H: Fn(NatsRequest) -> Fut,
    Fut: Future<Output = Result<Bytes, E>>,
    E: Display,
{
    let correlation_id = request.headers.get(header::CORRELATION_ID).cloned();
    let deadline = request.deadline;
    let work = handler(request);
    let outcome = match deadline {
        Some(deadline) => {
            match tokio::time::timeout_at(deadline.instant(), deadline.scope(work)).await {
                Ok(outcome) => outcome,
                // Nobody waits any more: answering would be wasted.
                Err(_) => return,
            }
        }
        None => work.await,
    };
    let (status, payload) = match outcome {
        Ok(payload) => (STATUS_OK, payload),
        Err(error) => (STATUS_ERROR, Bytes::from(error.to_string())),
    };
    let mut headers = HeaderMap::new();
    let _ = insert(&mut headers, REPLY_STATUS, status);
    if let Some(id) = correlation_id {
        let _ = insert(&mut headers, header::CORRELATION_ID, &id);
    }
    if let Err(error) = client
        .publish_with_headers(reply_to, headers, payload)
        .await
    {
        tracing::warn!(%error, "publishing a reply failed");
    }
}

fn insert(map: &mut HeaderMap, name: &str, value: &str) -> Result<(), ReplyError> {
    let name = HeaderName::from_str(name)
        .map_err(|e| ReplyError::Invalid(format!("header {name:?}: {e}")))?;
    if value.contains(['\r', '\n']) {
        return Err(ReplyError::Invalid(format!(
            "header value {value:?} has a line break"
        )));
    }
    let value = HeaderValue::from_str(value)
        .map_err(|e| ReplyError::Invalid(format!("header value {value:?}: {e}")))?;
    map.insert(name, value);
    Ok(())
}

fn to_header_map(headers: &Headers) -> Result<HeaderMap, ReplyError> {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        insert(&mut map, name, value)?;
    }
    Ok(map)
}

fn from_header_map(map: Option<&HeaderMap>) -> Headers {
    let mut headers = Headers::new();
    for (name, values) in map.into_iter().flat_map(HeaderMap::iter) {
        if let Some(value) = values.first() {
            headers.insert(name.to_string(), value.as_str().to_owned());
        }
    }
    headers
}
