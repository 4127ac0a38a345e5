//! [`Idempotency`]: the service that runs the protocol.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use http_body_util::BodyExt;
use keel_core::BoxError;
use keel_store::StoreError;
use keel_store::{IdempotencyBegin, IdempotencyClaim, IdempotencyStore, StoredResponse};
use tower_service::Service;

use super::fingerprint::fingerprint;
use super::held::{Held, HeldKey};
use super::key::{IDEMPOTENT_REPLAYED, IdempotencyRejection, parse_key};
use super::lease::{Lease, LockLost};
use super::options::IdempotencyOptions;
use super::settle::{Settle, Settled};
use crate::body::BodyError;
use crate::problem::Problem;
pub use crate::response_future::ResponseFuture;

/// `Retry-After` on a `503` for a request that was stopped or whose
/// response was not recorded: the store may answer again in a moment.
const STOPPED_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The header on a replay whose body was too large to store.
pub const IDEMPOTENT_BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");

/// Headers never stored for replay: hop-by-hop ones, and those that describe
/// the original transfer rather than the response (`date`, lengths).
const NOT_REPLAYED: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TE,
    header::TRAILER,
    header::DATE,
    header::CONTENT_LENGTH,
];

/// Runs the Idempotency-Key protocol in front of `I`, with keys in `S`.
///
/// Built by [`IdempotencyLayer`](super::IdempotencyLayer); see the
/// [module docs](super) for the protocol.
#[derive(Debug, Clone)]
pub struct Idempotency<I, S> {
    inner: I,
    store: S,
    options: Arc<IdempotencyOptions>,
}

impl<I, S> Idempotency<I, S> {
    pub(crate) fn from_parts(inner: I, store: S, options: Arc<IdempotencyOptions>) -> Self {
        Self {
            inner,
            store,
            options,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &I {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut I {
        &mut self.inner
    }

    /// Unwraps the service.
    pub fn into_inner(self) -> I {
        self.inner
    }
}

impl<I, S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<I, S>
where
    I: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send,
    I::Error: Send + 'static,
    S: IdempotencyStore,
    ReqBody: HttpBody<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = I::Error;
    type Future = ResponseFuture<I::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; a fresh clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let store = self.store.clone();
        let options = Arc::clone(&self.options);
        ResponseFuture::new(run(inner, store, options, request.map(Body::new)))
    }
}

async fn run<I, S, ResBody>(
    mut inner: I,
    store: S,
    options: Arc<IdempotencyOptions>,
    request: Request<Body>,
) -> Result<Response<Body>, I::Error>
where
    I: Service<Request<Body>, Response = Response<ResBody>>,
    S: IdempotencyStore,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !options.methods.contains(request.method()) {
        return inner.call(request).await.map(|r| r.map(Body::new));
    }
    let (parts, body) = request.into_parts();
    let key = match parse_key(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if !options.required => {
            return inner
                .call(Request::from_parts(parts, body))
                .await
                .map(|r| r.map(Body::new));
        }
        Ok(None) => return Ok(IdempotencyRejection::MissingKey.into_response()),
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let body = match read_body(&parts, body, options.max_body).await {
        Ok(body) => body,
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let claimed = match claim_key(&store, &options, &parts, key, &body).await {
        Ok(claimed) => claimed,
        Err(answer) => return Ok(answer),
    };
    run_holding(inner, store, options, parts, body, claimed).await
}

/// A key this request claimed: the caller's, and the claim's owner id.
struct Claimed {
    principal: String,
    key: String,
    owner: String,
    /// When the claim was asked for (its lock runs from then).
    asked: keel_core::clock::Instant,
}

/// Claims `key` for this request, or the answer that ends it here: the
/// stored response replayed, `409` while another request holds the key,
/// `422` for a key reused with a different request, or the store's
/// failure.
async fn claim_key<S: IdempotencyStore>(
    store: &S,
    options: &IdempotencyOptions,
    parts: &Parts,
    key: String,
    body: &Bytes,
) -> Result<Claimed, Response<Body>> {
    let principal = (options.principal)(parts);
    let fingerprint = fingerprint(parts, &options.fingerprint_headers, body);
    let now = wall_now();
    let owner = keel_core::id::new_id().to_string();
    let asked = keel_core::clock::now();
    let claim = IdempotencyClaim {
        principal: &principal,
        key: &key,
        fingerprint: &fingerprint,
        owner: &owner,
        locked_until: after(now, options.lock),
        expires_at: after(now, options.ttl),
    };
    match store.idempotency_begin(&claim).await {
        Ok(IdempotencyBegin::Started) => Ok(Claimed {
            principal,
            key,
            owner,
            asked,
        }),
        Ok(IdempotencyBegin::Completed(stored)) => {
            metrics::counter!("keel_idempotency_replayed_total").increment(1);
            tracing::debug!(%principal, %key, status = stored.status, "idempotent response replayed");
            Err(replay(stored))
        }
        Ok(IdempotencyBegin::InFlight) => Err(IdempotencyRejection::InFlight {
            retry_after: options.in_flight_retry_after,
        }
        .into_response()),
        Ok(IdempotencyBegin::Mismatch) => {
            tracing::info!(%principal, %key, "idempotency key reused for a different request");
            Err(IdempotencyRejection::KeyReused.into_response())
        }
        Err(err) => Err(store_failure(&err)),
    }
}

/// Runs the request under the claimed key, then completes the key with
/// the answer, or releases it.
async fn run_holding<I, S, ResBody>(
    mut inner: I,
    store: S,
    options: Arc<IdempotencyOptions>,
    mut parts: Parts,
    body: Bytes,
    claimed: Claimed,
) -> Result<Response<Body>, I::Error>
where
    I: Service<Request<Body>, Response = Response<ResBody>>,
    S: IdempotencyStore,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Claimed {
        principal,
        key,
        owner,
        asked,
    } = claimed;
    // From here the key is ours: whatever happens, it is completed or
    // released. The guard releases it if this future is dropped (the client
    // disconnected) or the handler panics, and renews its lock meanwhile.
    let held = Held::new(principal, key, owner, options.max_response_body);
    parts.extensions.insert(HeldKey::new(Arc::clone(&held)));
    let lease = Lease::new(store, Arc::clone(&held), options.lock, asked);
    let mut guard = InFlight { lease: Some(lease) };
    metrics::counter!("keel_idempotency_executed_total").increment(1);
    let work = async {
        let response = inner
            .call(Request::from_parts(parts, Body::from(body)))
            .await?;
        let (head, body) = response.into_parts();
        Ok((head, body.collect().await.map_err(Into::<BoxError>::into)))
    };
    let (mut head, collected) = match guard.hold(work).await {
        Ok(Ok(done)) => done,
        Ok(Err(err)) => {
            guard.release("service error").await;
            return Err(err);
        }
        Err(lost) => return Ok(guard.lost(lost)),
    };
    let body = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(err) => {
            guard.release("response body error").await;
            return Ok(Problem::internal(format!("response body failed: {err}")).into_response());
        }
    };
    if held.committed() {
        // The handler stored this answer in its own transaction.
        guard.disarm();
        return Ok(Response::from_parts(head, Body::from(body)));
    }
    if (options.release)(head.status) {
        guard.release("retryable status").await;
        return Ok(Response::from_parts(head, Body::from(body)));
    }
    let stored = to_stored(&head, &body, options.max_response_body);
    if guard.complete(&stored).await == Settled::Unconfirmed {
        // See `settle`: a fresh answer only for a confirmed key.
        return Ok(IdempotencyRejection::NotRecorded {
            retry_after: STOPPED_RETRY_AFTER,
        }
        .into_response());
    }
    // The stored copy has no length; the live response gets its own again.
    head.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(head, Body::from(body)))
}

/// Reads the whole body, refusing one over `limit`.
async fn read_body(parts: &Parts, body: Body, limit: usize) -> Result<Bytes, IdempotencyRejection> {
    crate::body::read_limited(&parts.headers, body, limit)
        .await
        .map_err(|err| match err {
            BodyError::TooLarge { limit } => IdempotencyRejection::BodyTooLarge { limit },
            BodyError::Unreadable(why) => IdempotencyRejection::UnreadableBody(why),
        })
}

/// The response to store for replay.
pub(super) fn to_stored(
    head: &axum::http::response::Parts,
    body: &Bytes,
    limit: usize,
) -> StoredResponse {
    let omit = body.len() > limit;
    let mut headers = Vec::with_capacity(head.headers.len());
    for (name, value) in &head.headers {
        if NOT_REPLAYED.contains(name)
            || (omit && (name == header::CONTENT_TYPE || name == header::CONTENT_ENCODING))
        {
            continue;
        }
        match value.to_str() {
            Ok(value) => headers.push((name.as_str().to_owned(), value.to_owned())),
            Err(_) => {
                tracing::warn!(header = %name, "non-ASCII response header not stored for replay")
            }
        }
    }
    if omit {
        metrics::counter!("keel_idempotency_body_omitted_total").increment(1);
        tracing::warn!(
            size = body.len(),
            limit,
            "idempotent response too large to store; its replay will have no body"
        );
        headers.push((
            IDEMPOTENT_BODY_OMITTED.as_str().to_owned(),
            "true".to_owned(),
        ));
    }
    StoredResponse {
        status: head.status.as_u16(),
        headers,
        body: if omit { Bytes::new() } else { body.clone() },
    }
}

/// The stored response again, marked as a replay.
fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

fn store_failure(err: &StoreError) -> Response<Body> {
    metrics::counter!("keel_idempotency_store_errors_total").increment(1);
    Problem::from_store(err).into_response()
}

/// A key this request holds in flight, released unless completed.
struct InFlight<S: IdempotencyStore> {
    lease: Option<Lease<S>>,
}

impl<S: IdempotencyStore> InFlight<S> {
    /// Runs `work` while the key's lock is renewed.
    async fn hold<F: Future>(&mut self, work: F) -> Result<F::Output, LockLost> {
        match self.lease.as_mut() {
            Some(lease) => lease.hold(work).await,
            None => Ok(work.await),
        }
    }

    /// Lets go of a key the handler completed in its own transaction.
    fn disarm(&mut self) {
        self.lease = None;
    }

    async fn complete(&mut self, response: &StoredResponse) -> Settled {
        self.settle(Settle::Complete(response.clone())).await
    }

    async fn release(&mut self, why: &'static str) {
        self.settle(Settle::Release(why)).await;
    }

    /// The answer when the lock could not be kept and the handler was
    /// stopped. A key taken over is left to its new owner; one whose
    /// renewal went unconfirmed is released in the background (the store
    /// may not answer for a while), so a retry need not wait for the lock
    /// once it does.
    fn lost(&mut self, lost: LockLost) -> Response<Body> {
        let lease = self.lease.take();
        if let (LockLost::Unconfirmed(err), Some(lease)) = (lost, lease) {
            tracing::warn!(error = %err, principal = %lease.held.principal, key = %lease.held.key,
                "the key store did not confirm a lock renewal; the request was stopped");
            tokio::spawn(lease.settle(Settle::Release("lock lost")));
        }
        IdempotencyRejection::LockLost {
            retry_after: STOPPED_RETRY_AFTER,
        }
        .into_response()
    }

    /// Settles in a task of its own: a client that hangs up while the
    /// response is being stored must not cut the write in half, or the key
    /// would stay locked with its effect done and no answer to replay.
    async fn settle(&mut self, settle: Settle) -> Settled {
        let Some(lease) = self.lease.take() else {
            return Settled::Confirmed;
        };
        tokio::spawn(lease.settle(settle))
            .await
            .unwrap_or_else(|err| {
                tracing::error!(error = %err, "settling an idempotency key panicked");
                Settled::Unconfirmed
            })
    }
}

impl<S: IdempotencyStore> Drop for InFlight<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(lease.settle(Settle::Release("request dropped")));
            }
            Err(_) => tracing::warn!(principal = %lease.held.principal, key = %lease.held.key,
                "idempotent request dropped outside a runtime; the key stays locked until its lock passes"),
        }
    }
}

/// Now, by the wall clock read through `keel_core::clock`.
pub(crate) fn wall_now() -> DateTime<Utc> {
    let ms = i64::try_from(keel_core::clock::unix_millis()).unwrap_or(i64::MAX);
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}

/// `at + d`, saturating at the latest representable time.
pub(crate) fn after(at: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}
