//! The reference system's HTTP API: one router for `keel serve` and
//! `keel demo` alike.

pub mod graphql;
pub mod orders;

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef};
use axum::http::request::Parts;
use axum::routing::{MethodRouter, get, post};
use keel_http::experiment::ExperimentLayer;
use keel_http::idempotency::{IdempotencyLayer, IdempotencyOptions};
use keel_http::pagination::Pagination;
use keel_http::propagation::{DeadlineLayer, TraceContextLayer};
use keel_messaging::Outbox;
use keel_realtime::{EventLog, Realtime, RealtimeOptions, StreamId};

use crate::shop::ShopStore;
use crate::shop::model::MAX_BODY_BYTES;

/// The longest deadline a caller may ask for; longer ones are capped.
pub const MAX_DEADLINE: Duration = Duration::from_secs(10);

/// What every handler shares. Cheap to clone.
pub struct AppState<S: ShopStore> {
    /// The store (business tables and Keel's).
    pub store: S,
    /// Where the inventory keeps its stock levels: the store itself, or
    /// the dependencies' own.
    pub inventory: S,
    /// The outbox `POST /orders` writes to.
    pub outbox: Outbox<S>,
    /// The per-customer event log.
    pub log: EventLog<S>,
    /// Cursor signing for `GET /orders`.
    pub pagination: Pagination,
    /// Whether `X-Keel-Demo-Fault` is honoured.
    pub demo_faults: bool,
    /// Shipping's delivery estimates for the order page.
    pub estimates: crate::shop::saga::DeliveryEstimates,
    /// The carriers' shipping quotes for the order page.
    pub quotes: crate::shop::quotes::CarrierQuotes,
    /// Whether `x-chaos-experiment` is honoured (from loopback clients).
    pub experiments: bool,
}

impl<S: ShopStore> Clone for AppState<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            inventory: self.inventory.clone(),
            outbox: self.outbox.clone(),
            log: self.log.clone(),
            pagination: self.pagination.clone(),
            demo_faults: self.demo_faults,
            estimates: self.estimates.clone(),
            quotes: self.quotes.clone(),
            experiments: self.experiments,
        }
    }
}

impl<S: ShopStore> FromRef<AppState<S>> for Pagination {
    fn from_ref(state: &AppState<S>) -> Self {
        state.pagination.clone()
    }
}

/// The stream a realtime request reads: `?customerId=` (the demo has no
/// login; a real deployment reads its session here instead).
pub fn stream_of(parts: &Parts) -> Option<StreamId> {
    let query = parts.uri.query()?;
    let customer = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == "customerId")
        .map(|(_, v)| v)?;
    if customer.is_empty()
        || customer.len() > 64
        || !customer
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return None;
    }
    StreamId::new(format!("customer:{customer}")).ok()
}

/// Errors building the router.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A layer's options are invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// What the realtime endpoints let in.
#[derive(Debug, Clone)]
pub struct EdgeLimits {
    /// Realtime connections one client address may hold.
    pub streams_per_client: usize,
    /// Origins whose pages may open `/ws` (clients sending no `Origin`,
    /// which are not browsers, are let in too).
    pub ws_origins: Vec<String>,
    /// How long an Idempotency-Key is remembered (then the retention pass
    /// deletes it).
    pub idempotency_ttl: Duration,
}

/// The public API: orders and realtime, behind the trace and deadline
/// layers. `drain` ends realtime connections on shutdown.
pub fn public_router<S: ShopStore>(
    state: AppState<S>,
    drain: tokio::sync::watch::Receiver<bool>,
    limits: &EdgeLimits,
) -> Result<Router, RouterError> {
    let idempotency = IdempotencyLayer::with_options(
        state.store.clone(),
        IdempotencyOptions::new()
            .ttl(limits.idempotency_ttl)
            .max_body(MAX_BODY_BYTES)
            .in_flight_retry_after(Duration::from_secs(1)),
    )
    .map_err(|e| RouterError::Config(e.to_string()))?;
    let realtime = Realtime::builder(state.log.clone(), stream_of)
        .options(
            RealtimeOptions::new()
                .allow_missing_origin(true)
                .allowed_origins(limits.ws_origins.iter().cloned())
                .max_connections(limits.streams_per_client, keel_realtime::DEFAULT_MAX_TOTAL),
        )
        .drain(drain)
        .build()
        .map_err(|e| RouterError::Config(e.to_string()))?;
    // The idempotency layer wraps POST alone: any other method answers
    // 405 with `Allow`, not a missing-key 400.
    let orders = get(orders::list_orders::<S>)
        .merge(post(orders::place_order::<S>).route_layer(idempotency));
    let deadline =
        DeadlineLayer::with_max(MAX_DEADLINE).map_err(|e| RouterError::Config(e.to_string()))?;
    let experiments = ExperimentLayer::builder()
        .enabled(state.experiments)
        .build();
    let graphql = graphql::ShopGraphql::new(
        std::sync::Arc::new(graphql::loaders::ShopView {
            shop: state.store.clone(),
            inventory: state.inventory.clone(),
        }),
        state.pagination.clone(),
    );
    // Per route, not router-wide: a method the route does not serve is a
    // 405 with `Allow` before anything else, even with a deadline that has
    // passed (router-wide, the deadline's 504 came first). The experiment
    // runs inside the deadline: an injected delay counts against it, as a
    // slow dependency's would.
    let guarded = |route: MethodRouter<AppState<S>>| {
        route
            .route_layer(experiments.clone())
            .route_layer(deadline.clone())
    };
    Ok(Router::new()
        .route("/graphql", guarded(graphql.query_route()))
        .route(
            "/graphql/schema.graphql",
            guarded(graphql::ShopGraphql::sdl_route()),
        )
        .route("/orders", guarded(orders))
        .route("/orders/{id}", guarded(get(orders::get_order::<S>)))
        .route(
            "/orders/{id}/shipping-quotes",
            guarded(get(orders::shipping_quotes::<S>)),
        )
        .route("/updates", guarded(realtime.long_poll()))
        .route("/stream", guarded(realtime.sse()))
        // Any method upgrades (HTTP/2 extended CONNECT as well as GET): no
        // 405 to keep first.
        .route(
            "/ws",
            realtime
                .websocket()
                .layer::<_, Infallible>(experiments.clone())
                .layer::<_, Infallible>(deadline.clone()),
        )
        .with_state(state)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        // A malformed traceparent starts a new trace, as W3C Trace Context
        // says: a client's broken tracer never fails its orders.
        .layer(TraceContextLayer::new().lenient()))
}

pub mod openapi;
pub mod reports;
pub mod webhooks;
