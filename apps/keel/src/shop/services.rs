//! The shop's dependencies as real services on loopback: payments,
//! inventory and notifications over HTTP, shipping over gRPC (its
//! shipments; its estimates and carrier quotes are HTTP reads).
//!
//! They run in the same process (so `keel demo` needs nothing installed)
//! but are called over HTTP through the policy pipeline, exactly as remote
//! services would be. Each dedupes by the `Idempotency-Key` it receives:
//! the effect is a row in `shop_effects`, unique per key, so a retried
//! capture charges once. A refund or a release names the key of the action
//! it undoes and tombstones it: that action, arriving late, is refused with
//! `409` instead of landing after its undo. Payments can be made flaky on a schedule
//! ([`PaymentsFaults`]): it fails with `503`, then answers too slowly, then
//! captures and answers too late, then captures and answers `500`, then
//! recovers. The last two are the dependency a saga must not trust: the
//! work is done, and the answer says nothing or says it failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use keel_http::problem::Problem;
use keel_store::StoreError;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::db::{Capture, Reservation, ShopDb};
use super::model::{Item, ShippingQuote};
use super::quotes::{CARRIERS, SLOW_CARRIER, SLOW_CARRIER_DELAY};

/// When the payments service misbehaves: from the `start_after`-th
/// capture request on, it answers `503` for `fail_for`, then answers
/// captures only after `slow_delay` (longer than the caller's attempt
/// timeout) for `slow_for`, then for `late_for` captures first and answers
/// after `slow_delay`, then for `error_for` captures and answers `500`,
/// then recovers. Time-based rather than counted
/// in requests, because an open breaker stops requests from arriving: an
/// outage measured in requests would never end.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PaymentsFaults {
    /// Healthy captures before the outage (`None`: never misbehave).
    pub start_after: Option<u64>,
    /// How long captures fail.
    pub fail_for: Duration,
    /// How long captures are slow after that.
    pub slow_for: Duration,
    /// How slow.
    pub slow_delay: Duration,
    /// How long captures are applied, then answered after `slow_delay`.
    pub late_for: Duration,
    /// How long captures are applied, then answered with `500`.
    pub error_for: Duration,
}

impl PaymentsFaults {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// The demo's schedule for about `orders` orders: healthy for the first
    /// fifth of the captures, then 0.7 s of failures, 0.7 s of slow answers,
    /// 0.3 s of captures answered too late and 0.3 s of captures answered
    /// `500`, then healthy again.
    pub fn demo(orders: u64) -> Self {
        Self {
            start_after: Some(orders / 5),
            fail_for: Duration::from_millis(700),
            slow_for: Duration::from_millis(700),
            slow_delay: Duration::from_millis(600),
            late_for: Duration::from_millis(300),
            error_for: Duration::from_millis(300),
        }
    }
}

/// What the payments service does with a capture request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Healthy,
    Failing,
    Slow,
    /// Captures, then answers after `slow_delay`.
    AppliedThenLate,
    /// Captures, then answers `500`.
    AppliedThenError,
}

/// The base URLs of the running dependencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DependencyUrls {
    /// Payments: `POST /captures`, `POST /refunds`.
    pub payments: String,
    /// Inventory: `POST /reservations`, `POST /releases`.
    pub inventory: String,
    /// Shipping's reads: `GET /estimates/{customer}`,
    /// `GET /carriers/{carrier}/quotes/{customer}`.
    pub shipping: String,
    /// Shipping's gRPC service (`shipping.v1.Shipping`), `http://IP:PORT`.
    pub shipping_grpc: String,
    /// Notifications: `POST /receipts`.
    pub notifications: String,
}

impl DependencyUrls {
    /// The sockets the dependencies listen on (each URL's `IP:PORT`).
    pub fn sockets(&self) -> Vec<std::net::SocketAddr> {
        [
            &self.payments,
            &self.inventory,
            &self.shipping,
            &self.shipping_grpc,
            &self.notifications,
        ]
        .into_iter()
        .filter_map(|url| {
            let authority = url.split("://").nth(1)?.split('/').next()?;
            authority.parse().ok()
        })
        .collect()
    }
}

struct ServiceState<S> {
    db: S,
    faults: PaymentsFaults,
    captures_seen: AtomicU64,
    outage_began: std::sync::OnceLock<keel_core::clock::Instant>,
}

impl<S> ServiceState<S> {
    fn mode(&self) -> Mode {
        let n = self.captures_seen.fetch_add(1, Ordering::Relaxed);
        let Some(start) = self.faults.start_after else {
            return Mode::Healthy;
        };
        if n < start {
            return Mode::Healthy;
        }
        let began = *self.outage_began.get_or_init(keel_core::clock::now);
        let elapsed = began.elapsed();
        let f = &self.faults;
        let phases = [
            (f.fail_for, Mode::Failing),
            (f.slow_for, Mode::Slow),
            (f.late_for, Mode::AppliedThenLate),
            (f.error_for, Mode::AppliedThenError),
        ];
        let mut end = Duration::ZERO;
        for (span, mode) in phases {
            end += span;
            if elapsed < end {
                return mode;
            }
        }
        Mode::Healthy
    }
}

type Shared<S> = Arc<ServiceState<S>>;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderRef {
    order_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CaptureRequest {
    order_id: String,
    amount_cents: i64,
}

/// A compensation: the order, and the idempotency key of the action it
/// undoes, which it tombstones so that action is refused if it arrives
/// late.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Undo {
    order_id: String,
    action_key: String,
}

/// `409`: the action's key was undone before the action arrived.
fn undone(key: &str) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        format!("`{key}` was compensated before this request arrived: refused"),
    )
    .typed("shop:undone")
    .into_response()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reserve {
    order_id: String,
    items: Vec<Item>,
}

fn key(headers: &HeaderMap) -> Result<String, Problem> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() <= 255)
        .map(str::to_owned)
        .ok_or_else(|| Problem::bad_request("Idempotency-Key is required"))
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    serde_json::from_slice(body).map_err(|e| Problem::bad_request(format!("invalid body: {e}")))
}

/// A store failure, answered as every Keel component answers one: a lost
/// `COMMIT` says the effect may have landed (the caller retries with the
/// same key, or compensates), never just "unavailable".
fn store_failure(err: StoreError) -> Response {
    Problem::from_store(&err).into_response()
}

fn applied(new: bool) -> Response {
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({ "applied": new })),
    )
        .into_response()
}

async fn capture<S: ShopDb>(
    State(state): State<Shared<S>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let mode = state.mode();
    match mode {
        Mode::Failing => {
            return Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "payments is down (scheduled fault)",
            )
            .into_response();
        }
        Mode::Slow => {
            // The caller gives up first; its dropped connection cancels this
            // handler before the capture, like a request lost in a slow network.
            tokio::time::sleep(state.faults.slow_delay).await;
        }
        Mode::Healthy | Mode::AppliedThenLate | Mode::AppliedThenError => {}
    }
    let (key, req) = match (key(&headers), parse::<CaptureRequest>(&body)) {
        (Ok(k), Ok(r)) => (k, r),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    if req.amount_cents <= 0 {
        return Problem::bad_request("amountCents must be positive").into_response();
    }
    let answer = match state
        .db
        .capture(&key, &req.order_id, req.amount_cents)
        .await
    {
        Ok(Capture::Charged(new)) => applied(new),
        Ok(Capture::Undone) => undone(&key),
        Err(e) => store_failure(e),
    };
    match mode {
        // The capture is durable; the answer comes after the caller gave
        // up (its dropped connection cancels this sleep: no answer at all).
        Mode::AppliedThenLate => {
            tokio::time::sleep(state.faults.slow_delay).await;
            answer
        }
        Mode::AppliedThenError => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "payments failed before answering (scheduled fault); the capture may have \
             been made",
        )
        .into_response(),
        _ => answer,
    }
}

async fn refund<S: ShopDb>(
    State(state): State<Shared<S>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (key, req) = match (key(&headers), parse::<Undo>(&body)) {
        (Ok(k), Ok(r)) => (k, r),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    match state.db.refund(&key, &req.order_id, &req.action_key).await {
        Ok(new) => applied(new),
        Err(e) => store_failure(e),
    }
}

async fn reserve<S: ShopDb>(
    State(state): State<Shared<S>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (key, req) = match (key(&headers), parse::<Reserve>(&body)) {
        (Ok(k), Ok(r)) => (k, r),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    match state.db.reserve(&key, &req.order_id, &req.items).await {
        Ok(Reservation::Reserved) => applied(true),
        Ok(Reservation::Undone) => undone(&key),
        Ok(Reservation::OutOfStock(sku)) => {
            Problem::new(StatusCode::CONFLICT, format!("out of stock: {sku}"))
                .typed("shop:out_of_stock")
                .into_response()
        }
        Err(e) => store_failure(e),
    }
}

async fn release<S: ShopDb>(
    State(state): State<Shared<S>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (key, req) = match (key(&headers), parse::<Undo>(&body)) {
        (Ok(k), Ok(r)) => (k, r),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    match state.db.release(&key, &req.order_id, &req.action_key).await {
        Ok(new) => applied(new),
        Err(e) => store_failure(e),
    }
}

async fn effect<S: ShopDb>(
    state: Shared<S>,
    headers: HeaderMap,
    body: &[u8],
    step: &str,
) -> Response {
    let (key, req) = match (key(&headers), parse::<OrderRef>(body)) {
        (Ok(k), Ok(r)) => (k, r),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    match state.db.record_effect(&key, &req.order_id, step).await {
        Ok(new) => applied(new),
        Err(e) => store_failure(e),
    }
}

async fn receipt<S: ShopDb>(
    State(state): State<Shared<S>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    effect(state, headers, &body, "send_receipt").await
}

/// `GET /estimates/{customer}`: days until delivery (a read, so no key).
async fn estimate(axum::extract::Path(customer): axum::extract::Path<String>) -> Response {
    let days = 2 + customer.bytes().map(u32::from).sum::<u32>() % 4;
    axum::Json(serde_json::json!({ "days": days })).into_response()
}

/// `GET /carriers/{carrier}/quotes/{customer}`: a carrier's price and
/// days; `slowboat` takes [`SLOW_CARRIER_DELAY`] to answer, an unknown
/// carrier is a `404`.
async fn carrier_quote(
    axum::extract::Path((carrier, customer)): axum::extract::Path<(String, String)>,
) -> Response {
    let Some(rank) = CARRIERS.iter().position(|c| *c == carrier) else {
        return Problem::not_found(format!("no carrier {carrier}")).into_response();
    };
    if carrier == SLOW_CARRIER {
        tokio::time::sleep(SLOW_CARRIER_DELAY).await;
    }
    let rank = u32::try_from(rank).unwrap_or(0);
    let base = 2 + customer.bytes().map(u32::from).sum::<u32>() % 4;
    axum::Json(ShippingQuote {
        carrier,
        price_cents: 499 + 250 * i64::from(2 - rank.min(2)),
        days: base + rank,
    })
    .into_response()
}

/// The experiment the demo runs on shipping: in [`SHIPPING_OUTAGE`],
/// estimates fail with `503` (the shop serves its last good one).
pub const SHIPPING_OUTAGE: &str = "shipping-outage";

fn shipping_experiments() -> keel_http::experiment::ExperimentLayer {
    let outage = keel_policy::chaos::FaultInjection::builder("shipping-estimates")
        .experiment(SHIPPING_OUTAGE)
        .abort(100.0)
        .enabled(true)
        .build();
    let layer = keel_http::experiment::ExperimentLayer::builder().enabled(true);
    match outage {
        Ok(outage) => layer.fault("/estimates/{customer}", outage),
        Err(error) => {
            tracing::error!(%error, "the shipping experiment is misconfigured; not offered");
            layer
        }
    }
    .build()
}

async fn serve(router: Router, shutdown: watch::Receiver<bool>) -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let mut shutdown = shutdown;
        let stop = async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        };
        // With each client's address: the experiment layer trusts loopback.
        let app = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
        if let Err(err) = axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::error!(error = %err, "dependency server failed");
        }
    });
    Ok(format!("http://{addr}"))
}

/// Starts the four dependencies, each its own server, until `shutdown`
/// turns `true`: the HTTP ones on `127.0.0.1:0`, shipping's gRPC server on
/// `config.shipping_grpc`.
pub async fn start_dependencies<S: ShopDb>(
    db: S,
    config: &super::SystemConfig,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<DependencyUrls> {
    let grpc = TcpListener::bind(config.shipping_grpc).await?;
    let access = super::shipping::GrpcAccess {
        token: config.shipping_grpc_token.clone(),
        limits: config.connection_limits.clone(),
    };
    let shipping_grpc = super::shipping::serve(
        grpc,
        super::shipping::ShippingService::new(db.clone(), config.courier_pace),
        access,
        shutdown.clone(),
    )
    .await?;
    let state = Arc::new(ServiceState {
        db,
        faults: config.payments_faults.clone(),
        captures_seen: AtomicU64::new(0),
        outage_began: std::sync::OnceLock::new(),
    });
    let payments = Router::new()
        .route("/captures", post(capture::<S>))
        .route("/refunds", post(refund::<S>))
        .with_state(Arc::clone(&state));
    let inventory = Router::new()
        .route("/reservations", post(reserve::<S>))
        .route("/releases", post(release::<S>))
        .with_state(Arc::clone(&state));
    let shipping = Router::new()
        .route("/estimates/{customer}", get(estimate))
        .route("/carriers/{carrier}/quotes/{customer}", get(carrier_quote))
        .with_state(Arc::clone(&state))
        .layer(shipping_experiments());
    let notifications = Router::new()
        .route("/receipts", post(receipt::<S>))
        .with_state(state);
    Ok(DependencyUrls {
        payments: serve(payments, shutdown.clone()).await?,
        inventory: serve(inventory, shutdown.clone()).await?,
        shipping: serve(shipping, shutdown.clone()).await?,
        notifications: serve(notifications, shutdown).await?,
        shipping_grpc: format!("http://{shipping_grpc}"),
    })
}
