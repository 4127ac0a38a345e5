//! Completing the key in the handler's own transaction.
//!
//! By default a request behind the layer costs three write transactions:
//! the key's begin, the handler's own, and the layer storing the response
//! after the handler returned. A handler whose effect lives in the same
//! store can fold the third into its own: [`HeldKey::complete_in`] stores
//! the response inside the handler's transaction, so the key completes
//! exactly when the effect commits, and the layer has nothing left to
//! write. It also closes the window between the two commits, in which a
//! store outage left an effect without its stored answer.
//!
//! How the handler proves its commit, and an example, are on
//! [`HeldKey`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::body::Body;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::{Response, header};
use axum::response::IntoResponse;
use http_body_util::BodyExt;
use keel_core::BoxError;
use keel_store::IdempotencyStore;
use keel_store::StoreError;

use super::service::to_stored;
use crate::problem::Problem;

/// Where the key stands in the handler's transaction.
const NOT_WRITTEN: u8 = 0;
const WRITTEN: u8 = 1;
const COMMITTED: u8 = 2;

/// The key a request holds in flight, shared between the layer and the
/// handler's [`HeldKey`].
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) principal: String,
    pub(crate) key: String,
    pub(crate) owner: String,
    max_response_body: usize,
    stage: AtomicU8,
}

impl Held {
    pub(crate) fn new(
        principal: String,
        key: String,
        owner: String,
        max_response_body: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            principal,
            key,
            owner,
            max_response_body,
            stage: AtomicU8::new(NOT_WRITTEN),
        })
    }

    /// The handler wrote the completion into its transaction: a renewal
    /// that no longer finds the key in flight has met that commit, not a
    /// takeover.
    pub(crate) fn written(&self) -> bool {
        self.stage.load(Ordering::Acquire) >= WRITTEN
    }

    /// The handler committed the completion: the layer writes nothing.
    pub(crate) fn committed(&self) -> bool {
        self.stage.load(Ordering::Acquire) == COMMITTED
    }
}

/// The `Idempotency-Key` this request holds in flight, for a handler that
/// stores its response in its own transaction: the key completes exactly
/// when the handler's effect commits, and the layer writes nothing after
/// the handler. An extractor: a route behind
/// [`IdempotencyLayer`](super::IdempotencyLayer) finds it on every request
/// whose key it began; `Option<HeldKey>` where the key is optional.
///
/// The handler proves the commit by turning the [`Completion`] into its
/// response with [`Completion::committed`]; a completion dropped unused
/// (the transaction rolled back, or its commit failed) leaves the key to
/// the layer, which completes or releases it as usual.
///
/// ```
/// use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
/// use axum::extract::State;
/// use axum::response::{IntoResponse, Response};
/// use keel_http::idempotency::{HeldKey, IdempotencyLayer};
/// use keel_store::Store;
/// use keel_sqlite::SqliteStore;
/// use tower::ServiceExt;
///
/// async fn place(State(store): State<SqliteStore>, held: HeldKey) -> Response {
///     let mut tx = store.begin().await.expect("begin");
///     sqlx::query("INSERT INTO orders (id) VALUES ('A-4471')")
///         .execute(&mut *tx)
///         .await
///         .expect("insert");
///     // The last statement: the key's row stays locked until the commit.
///     let completion = held
///         .complete_in(&store, &mut tx, (StatusCode::CREATED, "order A-4471"))
///         .await
///         .expect("complete in the transaction");
///     match store.commit(tx).await {
///         Ok(()) => completion.committed(),
///         Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let store = SqliteStore::open_in_memory().await?;
/// # let mut tx = store.begin().await?;
/// # sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)").execute(&mut *tx).await?;
/// # store.commit(tx).await?;
/// let app = Router::new()
///     .route("/orders", post(place))
///     .layer(IdempotencyLayer::new(store.clone()))
///     .with_state(store);
/// let place = || {
///     Request::post("/orders")
///         .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
///         .body(Body::empty())
/// };
/// assert_eq!(app.clone().oneshot(place()?).await?.status(), StatusCode::CREATED);
/// let retry = app.oneshot(place()?).await?;
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct HeldKey {
    held: Arc<Held>,
}

/// Why [`HeldKey::complete_in`] stored nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompleteInError {
    /// The response body could not be read; nothing was written.
    #[error("the response body to store could not be read: {0}")]
    Body(BoxError),
    /// The store refused the write: [`StoreError::NotFound`] if the key is
    /// no longer this request's (the request is being stopped), otherwise
    /// the transaction's own failure. Roll back and answer as for any
    /// failed write.
    #[error("storing the idempotent response failed: {0}")]
    Store(#[from] StoreError),
}

/// A response stored in the handler's transaction, given back once that
/// transaction committed.
#[derive(Debug)]
#[must_use = "answer with `committed()` once the transaction committed"]
pub struct Completion {
    held: Arc<Held>,
    response: Response<Body>,
}

impl HeldKey {
    pub(crate) fn new(held: Arc<Held>) -> Self {
        Self { held }
    }

    /// The key, as the client sent it.
    pub fn key(&self) -> &str {
        &self.held.key
    }

    /// Whose key it is ([`IdempotencyOptions::principal`](super::IdempotencyOptions::principal)).
    pub fn principal(&self) -> &str {
        &self.held.principal
    }

    /// Stores `response` as the key's answer inside `tx`, which must belong
    /// to the layer's own store. Call it last, right before the commit:
    /// the key's row stays locked until `tx` ends, and the layer's lock
    /// renewal waits for it.
    pub async fn complete_in<S: IdempotencyStore>(
        &self,
        store: &S,
        tx: &mut S::Tx,
        response: impl IntoResponse,
    ) -> Result<Completion, CompleteInError> {
        let (mut head, body) = response.into_response().into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| CompleteInError::Body(e.into()))?
            .to_bytes();
        let stored = to_stored(&head, &body, self.held.max_response_body);
        let held = &self.held;
        store
            .idempotency_complete_in(tx, &held.principal, &held.key, &held.owner, &stored)
            .await?;
        held.stage.fetch_max(WRITTEN, Ordering::AcqRel);
        head.headers.remove(header::CONTENT_LENGTH);
        Ok(Completion {
            held: Arc::clone(held),
            response: Response::from_parts(head, Body::from(body)),
        })
    }
}

impl Completion {
    /// The response to send, now that the transaction holding it
    /// committed: the layer has nothing left to store.
    pub fn committed(self) -> Response<Body> {
        self.held.stage.store(COMMITTED, Ordering::Release);
        self.response
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        <Self as OptionalFromRequestParts<S>>::from_request_parts(parts, state)
            .await?
            .ok_or_else(|| {
                Problem::internal(
                    "no Idempotency-Key is held for this request: put the route behind \
                     IdempotencyLayer, or take Option<HeldKey> where the key is optional",
                )
            })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}
