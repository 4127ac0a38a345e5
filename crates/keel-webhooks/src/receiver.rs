//! Receiving webhooks: an axum extractor that verifies the signature over
//! the raw body, refuses stale timestamps, dedupes on the webhook id, and
//! ready-made routes that answer `200` at once and hand the work on.
//!
//! The receiving checklist, and where each item is:
//!
//! - **verify the signature on the RAW body, in constant time**: the body is
//!   read as bytes (never re-serialised) up to a limit, and every signature
//!   is compared with [`subtle`] for every configured secret (two during a
//!   rotation) — see [`Verifier`];
//! - **reject stale timestamps**: outside ±5 minutes is `400`, so a
//!   captured request cannot be replayed later;
//! - **deduplicate on the event id**: a window of recently seen
//!   `webhook-id`s (in memory, bounded by age and count); a duplicate gets
//!   `200` without the handler running. For dedupe across restarts and
//!   across the sender's whole retry schedule use
//!   [`outbox_route`](WebhookReceiver::outbox_route), which dedupes in the
//!   store's inbox, in the same transaction that hands the work on;
//! - **return 2xx immediately, process asynchronously**:
//!   [`channel_route`](WebhookReceiver::channel_route) puts the webhook in a
//!   bounded channel, [`outbox_route`](WebhookReceiver::outbox_route) in the
//!   outbox, and both answer at once. A full channel answers `503` +
//!   `Retry-After` and forgets the id, so the sender's retry is processed;
//! - **tolerate out-of-order arrival**: order by the body's `timestamp` (or
//!   `sequence`), never by arrival.
//!
//! Every refusal is an `application/problem+json` answer: a malformed or
//! missing header, a stale or future timestamp and invalid JSON are `400`,
//! a signature that does not verify is `401`, a body over the limit `413`.
//!
//! ```
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use keel_webhooks::{VerifiedWebhook, WebhookReceiver};
//! use keel_webhooks::signing::{Secret, SignatureScheme, signature_headers};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
//! let receiver = WebhookReceiver::new([secret.clone()]);
//! let app = Router::new()
//!     .route("/webhooks", post(|hook: VerifiedWebhook| async move {
//!         // Hand `hook.payload` to a queue here and return at once.
//!         hook.payload["type"].as_str().unwrap_or_default().to_owned()
//!     }))
//!     .with_state(receiver);
//!
//! let body = r#"{"type":"order.paid","data":{}}"#;
//! let now = keel_core::clock::unix_seconds() as i64;
//! let mut request = Request::post("/webhooks").body(Body::from(body)).unwrap();
//! for (name, value) in signature_headers(&SignatureScheme::default(), [&secret], "evt_1", now, body.as_bytes()).unwrap() {
//!     request.headers_mut().insert(name, value);
//! }
//! let response = app.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use bytes::Bytes;
use keel_core::clock::{self, Instant};
use keel_store::broker::Headers;
use keel_store::{InboxStore, OutboxRecord, OutboxStore};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::WallClock;
use super::signing::{
    Secret, SignatureScheme, Verified, Verifier, VerifyError, WEBHOOK_ID, WEBHOOK_TIMESTAMP,
};
use keel_http::body::BodyError;
use keel_http::problem::Problem;

/// The largest body read by default: 256 KiB (the sender's default cap).
pub const DEFAULT_MAX_BODY: usize = 256 * 1024;
/// How long a webhook id is remembered by default: 1 hour.
pub const DEFAULT_DEDUP_TTL: Duration = Duration::from_secs(3600);
/// The most webhook ids remembered at once by default.
pub const DEFAULT_DEDUP_CAPACITY: usize = 100_000;
/// The `Retry-After` of a `503` from a full hand-off channel or an
/// unavailable store.
pub const BUSY_RETRY_AFTER: Duration = Duration::from_secs(5);

/// A receiver's configuration: secrets, scheme, tolerance, body limit and
/// dedupe window. Cheap to clone (an `Arc`); use it as (part of) the router
/// state for [`VerifiedWebhook`] (`FromRef`).
#[derive(Clone)]
pub struct WebhookReceiver {
    inner: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    verifier: Verifier,
    max_body: usize,
    seen: Option<Arc<Mutex<SeenIds>>>,
    clock: WallClock,
}

impl fmt::Debug for WebhookReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookReceiver")
            .field("verifier", &self.inner.verifier)
            .field("max_body", &self.inner.max_body)
            .field("dedup", &self.inner.seen.is_some())
            .finish_non_exhaustive()
    }
}

impl WebhookReceiver {
    /// A Standard Webhooks receiver accepting any of `secrets` (two during
    /// a rotation), ±5 minutes, a 256 KiB body limit and a one-hour dedupe
    /// window of 100,000 ids.
    pub fn new(secrets: impl IntoIterator<Item = Secret>) -> Self {
        Self {
            inner: Arc::new(Config {
                verifier: Verifier::new(secrets),
                max_body: DEFAULT_MAX_BODY,
                seen: Some(Arc::new(Mutex::new(SeenIds::new(
                    DEFAULT_DEDUP_TTL,
                    DEFAULT_DEDUP_CAPACITY,
                )))),
                clock: WallClock::system(),
            }),
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.inner)
    }

    /// Verifies the `t=<timestamp>,v1=<hex>` format instead.
    pub fn scheme(mut self, scheme: SignatureScheme) -> Self {
        let config = self.config();
        config.verifier = config.verifier.clone().scheme(scheme);
        self
    }

    /// How far the timestamp may be from now, either way (default 5 minutes).
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        let config = self.config();
        config.verifier = config.verifier.clone().tolerance(tolerance);
        self
    }

    /// The largest body read, in bytes (default 256 KiB); larger is `413`.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.config().max_body = bytes;
        self
    }

    /// Remembers ids for `ttl`, at most `capacity` of them (oldest go first).
    pub fn dedup_window(mut self, ttl: Duration, capacity: usize) -> Self {
        self.config().seen = Some(Arc::new(Mutex::new(SeenIds::new(ttl, capacity.max(1)))));
        self
    }

    /// No in-memory dedupe (the handler or the inbox dedupes).
    pub fn without_dedup(mut self) -> Self {
        self.config().seen = None;
        self
    }

    /// The wall clock timestamps are checked against (default: the system's).
    pub fn clock(mut self, clock: WallClock) -> Self {
        self.config().clock = clock;
        self
    }

    /// Verifies headers and raw body against the configured secrets, now.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<Verified, VerifyError> {
        self.inner
            .verifier
            .verify(headers, body, self.inner.clock.unix_seconds())
    }

    /// A `POST` route that verifies, dedupes, and puts each webhook into
    /// `queue` for a task to process, answering `200` at once (`503` +
    /// `Retry-After` if the queue is full: the sender retries later).
    pub fn channel_route<S>(&self, queue: mpsc::Sender<VerifiedWebhook>) -> MethodRouter<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let receiver = self.clone();
        axum::routing::post(move |request: Request| {
            let receiver = receiver.clone();
            let queue = queue.clone();
            async move {
                let webhook = match extract::<serde_json::Value>(&receiver, request).await {
                    Ok(webhook) => webhook,
                    Err(rejection) => return rejection.into_response(),
                };
                match queue.try_send(webhook) {
                    Ok(()) => received(),
                    Err(
                        mpsc::error::TrySendError::Full(webhook)
                        | mpsc::error::TrySendError::Closed(webhook),
                    ) => {
                        webhook.release();
                        metrics::counter!("keel_webhook_rejected_total", "reason" => "busy")
                            .increment(1);
                        WebhookRejection::Busy.into_response()
                    }
                }
            }
        })
    }

    /// A `POST` route that hands each webhook to the outbox: in one
    /// transaction it records the id in the inbox (scoped by `scope`) and,
    /// if it is new, appends the raw body to `topic` as an outbox event
    /// (id `webhook:<scope>:<webhook-id>`, headers `webhook-id`,
    /// `webhook-timestamp`, `content-type`). It answers `200` once that
    /// committed; a consumer then processes the event with retries and
    /// dead-lettering. A duplicate is `200` with nothing appended; a store
    /// failure `503` + `Retry-After`, so the sender retries.
    pub fn outbox_route<St, S>(
        &self,
        store: St,
        topic: impl Into<String>,
        scope: impl Into<String>,
    ) -> MethodRouter<S>
    where
        St: OutboxStore + InboxStore,
        S: Clone + Send + Sync + 'static,
    {
        let receiver = self.clone();
        let topic: Arc<str> = topic.into().into();
        let scope: Arc<str> = scope.into().into();
        axum::routing::post(move |request: Request| {
            let receiver = receiver.clone();
            let store = store.clone();
            let topic = Arc::clone(&topic);
            let scope = Arc::clone(&scope);
            async move {
                let webhook = match extract::<serde::de::IgnoredAny>(&receiver, request).await {
                    Ok(webhook) => webhook,
                    Err(rejection) => return rejection.into_response(),
                };
                match hand_to_outbox(&store, &webhook, &topic, &scope).await {
                    Ok(true) => received(),
                    Ok(false) => {
                        metrics::counter!("keel_webhook_received_total", "outcome" => "duplicate")
                            .increment(1);
                        WebhookRejection::Duplicate {
                            id: webhook.id.clone(),
                        }
                        .into_response()
                    }
                    Err(err) => {
                        webhook.release();
                        tracing::warn!(error = %err, id = %webhook.id, "could not hand a webhook to the outbox");
                        metrics::counter!("keel_webhook_rejected_total", "reason" => "unavailable")
                            .increment(1);
                        WebhookRejection::Unavailable.into_response()
                    }
                }
            }
        })
    }
}

async fn hand_to_outbox<St, T>(
    store: &St,
    webhook: &VerifiedWebhook<T>,
    topic: &str,
    scope: &str,
) -> Result<bool, keel_store::StoreError>
where
    St: OutboxStore + InboxStore,
{
    let mut tx = store.begin().await?;
    if !store.inbox_record(&mut tx, &webhook.id, scope).await? {
        store.rollback(tx).await?;
        return Ok(false);
    }
    let mut headers = Headers::new();
    headers.insert(WEBHOOK_ID.as_str().to_owned(), webhook.id.clone());
    headers.insert(
        WEBHOOK_TIMESTAMP.as_str().to_owned(),
        webhook.timestamp.to_string(),
    );
    headers.insert(
        header::CONTENT_TYPE.as_str().to_owned(),
        "application/json".to_owned(),
    );
    let record = OutboxRecord {
        event_id: format!("webhook:{scope}:{}", webhook.id),
        topic: topic.to_owned(),
        partition_key: webhook.id.clone(),
        headers,
        payload: webhook.body.clone(),
    };
    store.outbox_append(&mut tx, &[record]).await?;
    store.commit(tx).await?;
    Ok(true)
}

fn received() -> Response {
    metrics::counter!("keel_webhook_received_total", "outcome" => "accepted").increment(1);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"received":true}"#,
    )
        .into_response()
}

/// A verified webhook: its id, timestamp, parsed payload and raw body.
///
/// As an extractor it needs a [`WebhookReceiver`] in the router state
/// (`FromRef`). Its rejection is a [`WebhookRejection`]; a duplicate id is
/// answered `200` without running the handler.
pub struct VerifiedWebhook<T = serde_json::Value> {
    /// The `webhook-id` (the event id).
    pub id: String,
    /// The signed timestamp, in Unix seconds.
    pub timestamp: i64,
    /// The body, parsed.
    pub payload: T,
    /// The raw body, exactly as signed.
    pub body: Bytes,
    seen: Option<Arc<Mutex<SeenIds>>>,
}

impl<T: fmt::Debug> fmt::Debug for VerifiedWebhook<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifiedWebhook")
            .field("id", &self.id)
            .field("timestamp", &self.timestamp)
            .field("payload", &self.payload)
            .finish_non_exhaustive()
    }
}

impl<T> VerifiedWebhook<T> {
    /// Forgets the id in the dedupe window: call it when the webhook could
    /// not be handed on, so the sender's retry is processed rather than
    /// answered as a duplicate.
    pub fn release(&self) {
        if let Some(seen) = &self.seen {
            seen.lock().remove(&self.id);
        }
    }
}

impl<S, T> FromRequest<S> for VerifiedWebhook<T>
where
    WebhookReceiver: FromRef<S>,
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = WebhookRejection;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let receiver = WebhookReceiver::from_ref(state);
        extract(&receiver, request).await
    }
}

/// Reads, verifies, parses and dedupes (in that order: nothing
/// unauthenticated or unparsable touches the dedupe window).
async fn extract<T: DeserializeOwned>(
    receiver: &WebhookReceiver,
    request: Request,
) -> Result<VerifiedWebhook<T>, WebhookRejection> {
    let result = extract_inner(receiver, request).await;
    if let Err(rejection) = &result {
        let reason = rejection.kind();
        if reason == "duplicate" {
            metrics::counter!("keel_webhook_received_total", "outcome" => "duplicate").increment(1);
        } else {
            metrics::counter!("keel_webhook_rejected_total", "reason" => reason).increment(1);
            tracing::debug!(reason, error = %rejection, "webhook refused");
        }
    }
    result
}

async fn extract_inner<T: DeserializeOwned>(
    receiver: &WebhookReceiver,
    request: Request,
) -> Result<VerifiedWebhook<T>, WebhookRejection> {
    let config = &receiver.inner;
    let limit = config.max_body;
    let (parts, body) = request.into_parts();
    let body = keel_http::body::read_limited(&parts.headers, Body::new(body), limit)
        .await
        .map_err(|err| match err {
            BodyError::TooLarge { limit } => WebhookRejection::BodyTooLarge { limit },
            BodyError::Unreadable(why) => WebhookRejection::UnreadableBody(why),
        })?;
    let verified = receiver.verify(&parts.headers, &body)?;
    let payload: T =
        serde_json::from_slice(&body).map_err(|e| WebhookRejection::InvalidJson(e.to_string()))?;
    if let Some(seen) = &config.seen
        && !seen.lock().check_and_insert(&verified.id)
    {
        return Err(WebhookRejection::Duplicate { id: verified.id });
    }
    Ok(VerifiedWebhook {
        id: verified.id,
        timestamp: verified.timestamp,
        payload,
        body,
        seen: config.seen.clone(),
    })
}

/// Why a webhook was not handed to the handler. Each cause answers with its
/// own status and an `application/problem+json` body, except a duplicate,
/// which is answered `200` (the sender must stop retrying it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookRejection {
    /// A header is missing or malformed, or the timestamp is outside the
    /// tolerance (`400`), or the signature does not verify (`401`).
    #[error(transparent)]
    Verify(#[from] VerifyError),
    /// `413`: the body is over the limit.
    #[error("the webhook body is larger than the {limit}-byte limit")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// `400`: the body could not be read.
    #[error("the webhook body could not be read: {0}")]
    UnreadableBody(String),
    /// `400`: the (verified) body is not the JSON the handler expects.
    #[error("the webhook body is not valid JSON for this endpoint: {0}")]
    InvalidJson(String),
    /// `200`: this id was received before; the handler did not run again.
    #[error("webhook {id:?} was received before and is not processed again")]
    Duplicate {
        /// The id.
        id: String,
    },
    /// `503` + `Retry-After`: the hand-off queue is full.
    #[error("the webhook queue is full: retry later")]
    Busy,
    /// `503` + `Retry-After`: the webhook could not be stored.
    #[error("the webhook could not be stored: retry later")]
    Unavailable,
}

impl WebhookRejection {
    /// The HTTP status it answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Verify(VerifyError::BadSignature) => StatusCode::UNAUTHORIZED,
            Self::Verify(_) | Self::UnreadableBody(_) | Self::InvalidJson(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Duplicate { .. } => StatusCode::OK,
            Self::Busy | Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A short stable name for metrics labels and problem types.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Verify(VerifyError::MissingHeader(_)) => "missing_header",
            Self::Verify(VerifyError::InvalidHeader { .. }) => "invalid_header",
            Self::Verify(VerifyError::TooOld { .. } | VerifyError::TooNew { .. }) => {
                "timestamp_out_of_tolerance"
            }
            Self::Verify(VerifyError::BadSignature) => "bad_signature",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::UnreadableBody(_) => "unreadable_body",
            Self::InvalidJson(_) => "invalid_json",
            Self::Duplicate { .. } => "duplicate",
            Self::Busy => "busy",
            Self::Unavailable => "unavailable",
        }
    }
}

impl IntoResponse for WebhookRejection {
    fn into_response(self) -> Response {
        if let Self::Duplicate { .. } = self {
            return (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                r#"{"received":true,"duplicate":true}"#,
            )
                .into_response();
        }
        let mut problem = Problem::new(self.status(), self.to_string())
            .typed(&format!("webhook:{}", self.kind()));
        if matches!(self, Self::Busy | Self::Unavailable) {
            problem = problem.with_retry_after(BUSY_RETRY_AFTER);
        }
        problem.into_response()
    }
}

/// Recently seen webhook ids, bounded by age and by count, with removal
/// (unlike [`DedupWindow`](keel_store::dedup::DedupWindow), an id can be
/// forgotten when its webhook could not be handed on).
#[derive(Debug)]
struct SeenIds {
    ttl: Duration,
    capacity: usize,
    seen: HashMap<Arc<str>, Instant>,
    /// Insertion order (= time order); entries whose id was removed or
    /// re-inserted since are skipped when they reach the front.
    order: VecDeque<(Instant, Arc<str>)>,
}

impl SeenIds {
    fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl,
            capacity,
            seen: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// `true` if `id` is new (and now remembered).
    fn check_and_insert(&mut self, id: &str) -> bool {
        let now = clock::now();
        while let Some((at, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.ttl && self.seen.len() < self.capacity {
                break;
            }
            self.pop_oldest();
        }
        if self.seen.contains_key(id) {
            return false;
        }
        let id: Arc<str> = Arc::from(id);
        self.seen.insert(Arc::clone(&id), now);
        self.order.push_back((now, id));
        // Removed ids leave stale entries behind; keep the queue bounded.
        if self.order.len() > self.capacity.saturating_mul(2) {
            let seen = &self.seen;
            self.order.retain(|(at, id)| seen.get(id) == Some(at));
        }
        true
    }

    fn remove(&mut self, id: &str) {
        self.seen.remove(id);
    }

    fn pop_oldest(&mut self) {
        if let Some((at, id)) = self.order.pop_front()
            && self.seen.get(&id) == Some(&at)
        {
            self.seen.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests;
