//! A handler that completes its Idempotency-Key in its own transaction
//! ([`HeldKey::complete_in`]), against a real SQLite store: the layer then
//! writes nothing after the handler, a lock renewal meeting the committed
//! key does not stop the handler, and a completion rolled back with its
//! transaction leaves the key to the layer as before.
#![cfg(feature = "idempotency")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use chrono::{DateTime, Utc};
use keel_http::idempotency::{HeldKey, IdempotencyLayer, IdempotencyOptions};
use keel_http::problem::PROBLEM_JSON;
use keel_messaging::StoreError;
use keel_messaging::store::{
    IdempotencyBegin, IdempotencyClaim, IdempotencyStore, Store, StoredResponse,
};
use keel_sqlite::SqliteStore;
use tempfile::TempDir;
use tower::ServiceExt;

/// The SQLite store, counting the layer's completes and releases; with
/// `refuse_layer_complete`, the layer's own write of a response fails, so a
/// request answered `201` proves the layer never needed it.
#[derive(Clone)]
struct HandlerCompletes {
    inner: SqliteStore,
    layer_settles: Arc<AtomicUsize>,
    refuse_layer_complete: bool,
}

#[async_trait::async_trait]
impl Store for HandlerCompletes {
    type Tx = <SqliteStore as Store>::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }
    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for HandlerCompletes {
    async fn idempotency_begin(
        &self,
        claim: &IdempotencyClaim<'_>,
    ) -> Result<IdempotencyBegin, StoreError> {
        self.inner.idempotency_begin(claim).await
    }
    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        self.inner
            .idempotency_renew(principal, key, owner, locked_until)
            .await
    }
    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.layer_settles.fetch_add(1, Ordering::SeqCst);
        if self.refuse_layer_complete {
            return Err(StoreError::other("the layer was not meant to store this"));
        }
        self.inner
            .idempotency_complete(principal, key, owner, response)
            .await
    }
    async fn idempotency_complete_in(
        &self,
        tx: &mut Self::Tx,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.inner
            .idempotency_complete_in(tx, principal, key, owner, response)
            .await
    }
    async fn idempotency_release(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        self.layer_settles.fetch_add(1, Ordering::SeqCst);
        self.inner.idempotency_release(principal, key, owner).await
    }
    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        self.inner.idempotency_prune(now, batch).await
    }
}

struct Shop {
    store: HandlerCompletes,
    runs: Arc<AtomicUsize>,
    _dir: TempDir,
}

impl Shop {
    async fn open(refuse_layer_complete: bool) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let inner = SqliteStore::open(dir.path().join("keel.db"))
            .await
            .expect("open store");
        let mut tx = inner.begin().await.expect("begin");
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .execute(&mut *tx)
            .await
            .expect("orders table");
        inner.commit(tx).await.expect("commit");
        Self {
            store: HandlerCompletes {
                inner,
                layer_settles: Arc::default(),
                refuse_layer_complete,
            },
            runs: Arc::default(),
            _dir: dir,
        }
    }

    /// `POST /orders` behind the layer (lock `lock`), running `handler`.
    fn app<H, T>(&self, lock: Duration, handler: H) -> Router
    where
        H: axum::handler::Handler<T, Ctx>,
        T: 'static,
    {
        let layer = IdempotencyLayer::with_options(
            self.store.clone(),
            IdempotencyOptions::new().lock(lock),
        )
        .expect("options");
        Router::new()
            .route("/orders", post(handler).layer(layer))
            .with_state(Ctx {
                store: self.store.clone(),
                runs: Arc::clone(&self.runs),
            })
    }

    async fn orders(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(self.store.inner.pool())
            .await
            .expect("count orders")
    }
}

#[derive(Clone)]
struct Ctx {
    store: HandlerCompletes,
    runs: Arc<AtomicUsize>,
}

/// Inserts an order and, in the same transaction, completes the key with
/// `201`; waits `linger` after the commit before answering.
async fn place(ctx: &Ctx, held: &HeldKey, body: Bytes, linger: Duration) -> Response {
    let run = ctx.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut tx = ctx.store.begin().await.expect("begin");
    sqlx::query("INSERT INTO orders (body) VALUES ($1)")
        .bind(String::from_utf8_lossy(&body).into_owned())
        .execute(&mut *tx)
        .await
        .expect("insert");
    let response = (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{run}"))],
        format!("order {run} for {}", held.key()),
    );
    let completion = held
        .complete_in(&ctx.store, &mut tx, response)
        .await
        .expect("complete in the transaction");
    ctx.store.commit(tx).await.expect("commit");
    tokio::time::sleep(linger).await;
    completion.committed()
}

fn post_req(key: &str, body: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .expect("request")
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (parts.status, parts.headers, body)
}

#[tokio::test]
async fn the_key_completes_with_the_handlers_commit_and_the_layer_writes_nothing() {
    let shop = Shop::open(true).await;
    let app = shop.app(
        Duration::from_secs(10),
        |State(ctx): State<Ctx>, held: HeldKey, body: Bytes| async move {
            place(&ctx, &held, body, Duration::ZERO).await
        },
    );
    let (status, headers, body) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(&body[..], b"order 1 for k-1");

    let (again, replay_headers, replayed) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(replay_headers["idempotent-replayed"], "true");
    assert_eq!(replay_headers[header::LOCATION], "/orders/1");
    assert_eq!(
        replayed, body,
        "the replay is the first answer, byte for byte"
    );
    assert_eq!(shop.runs.load(Ordering::SeqCst), 1);
    assert_eq!(shop.orders().await, 1);
    assert_eq!(shop.store.layer_settles.load(Ordering::SeqCst), 0);
}

/// The layer renews the lock every third of it; a renewal after the
/// handler's commit no longer finds the key in flight. That is the
/// handler's own completion, not a takeover: the handler is not stopped.
#[tokio::test]
async fn a_renewal_after_the_commit_does_not_stop_the_handler() {
    let shop = Shop::open(true).await;
    let lock = Duration::from_millis(300);
    let app = shop.app(
        lock,
        move |State(ctx): State<Ctx>, held: HeldKey, body: Bytes| async move {
            place(&ctx, &held, body, lock * 2).await
        },
    );
    let (status, _, body) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(shop.store.layer_settles.load(Ordering::SeqCst), 0);
}

/// A completion whose transaction rolled back stored nothing: the layer
/// settles the key as for any handler, storing a `422` (replayed) and
/// releasing on a `503` (the retry runs again).
#[tokio::test]
async fn a_completion_rolled_back_leaves_the_key_to_the_layer() {
    let shop = Shop::open(false).await;
    let answer = Arc::new(parking_lot::Mutex::new(StatusCode::SERVICE_UNAVAILABLE));
    let app = {
        let answer = Arc::clone(&answer);
        shop.app(
            Duration::from_secs(10),
            move |State(ctx): State<Ctx>, held: HeldKey| async move {
                ctx.runs.fetch_add(1, Ordering::SeqCst);
                let mut tx = ctx.store.begin().await.expect("begin");
                let completion = held
                    .complete_in(&ctx.store, &mut tx, StatusCode::CREATED)
                    .await
                    .expect("complete in the transaction");
                ctx.store.rollback(tx).await.expect("rollback");
                drop(completion);
                let status = *answer.lock();
                status.into_response()
            },
        )
    };
    let (first, ..) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE);
    *answer.lock() = StatusCode::UNPROCESSABLE_ENTITY;
    let (second, headers, _) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(
        second,
        StatusCode::UNPROCESSABLE_ENTITY,
        "released: ran again"
    );
    assert!(!headers.contains_key("idempotent-replayed"));
    let (third, headers, _) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(third, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(shop.runs.load(Ordering::SeqCst), 2);
    // One release, one complete: both by the layer.
    assert_eq!(shop.store.layer_settles.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_route_outside_the_layer_has_no_held_key() {
    let shop = Shop::open(true).await;
    let app =
        Router::new()
            .route("/orders", post(|_: HeldKey| async { StatusCode::CREATED }))
            .route(
                "/maybe",
                post(|held: Option<HeldKey>| async move {
                    format!("{}", held.is_some()).into_response()
                }),
            );
    let (status, headers, _) = send(&app, post_req("k-1", "tea")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let maybe = Request::post("/maybe")
        .body(Body::empty())
        .expect("request");
    let (status, _, body) = send(&app, maybe).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"false"[..]));
    drop(shop);
}
