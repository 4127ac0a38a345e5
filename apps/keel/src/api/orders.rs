//! The orders API: `POST /orders`, `GET /orders`, `GET /orders/{id}`.
//!
//! `POST /orders` writes the order row, its `orders.placed` event (outbox)
//! and an `order.placed` entry in the customer's event log in ONE store
//! transaction, then answers `201`. The Idempotency-Key layer in front of
//! it makes a retried submission answer the first response instead of
//! placing a second order.
//!
//! The handler stores its `201` under the key in the order's own
//! transaction ([`HeldKey::complete_in`]), so the key completes exactly
//! when the order commits, and a request costs two write transactions (the
//! key's begin and the order) instead of three. A commit whose outcome is
//! unknown still leaves a retry to decide: the event id is derived from
//! the key (and the caller's `Authorization`, which is whose keys they
//! are), and unique, so a second run's insert finds the order placed under
//! it and answers with that order instead of placing another. The first
//! run reads nothing before its insert: only a run that finds an order
//! pays for reading it.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel_http::idempotency::{CompleteInError, Completion, HeldKey};
use keel_http::pagination::{Cursor, Page, PageRequest};
use keel_http::problem::Problem;
use keel_messaging::outbox::OutboxError;
use keel_realtime::AppendError;
use keel_store::StoreError;
use keel_store::envelope::{Envelope, EventMeta};
use serde::Deserialize;

use super::AppState;
use crate::shop::ShopStore;
use crate::shop::db::now_rfc3339;
use crate::shop::fulfilment::TOPIC;
use crate::shop::model::{DemoFault, NewOrder, Order, OrderPlaced, OrderStatus, ShippingQuotes};
use crate::shop::projection::customer_stream;

/// The CloudEvents source of the orders service.
pub const SOURCE: &str = "/keel/shop/orders";

fn unprocessable(detail: impl Into<String>) -> Problem {
    Problem::new(StatusCode::UNPROCESSABLE_ENTITY, detail)
}

/// A failed write of an order, as the store's problem
/// ([`Problem::from_store`]), but for a conflict: the order's event id is
/// unique, so a conflict is another attempt under the same
/// Idempotency-Key committing first, and the retry finds its order.
fn store_failed(err: &StoreError) -> Response {
    match err {
        StoreError::Conflict(what) => {
            tracing::info!(conflict = %what, "an attempt with the same key committed first");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "another attempt with this Idempotency-Key is committing; retry with the same key",
            )
            .typed("conflict_in_flight")
            .with_retry_after(std::time::Duration::from_secs(1))
        }
        other => Problem::from_store(other),
    }
    .into_response()
}

fn outbox_failed(err: &OutboxError) -> Response {
    match err {
        OutboxError::Store(err) => store_failed(err),
        other => Problem::from_outbox(other).into_response(),
    }
}

fn completion_failed(err: &CompleteInError) -> Response {
    match err {
        // A retry took the key over (this attempt's lock had passed): the
        // order rolls back, and the retry places it.
        CompleteInError::Store(StoreError::NotFound(_)) => Problem::new(
            StatusCode::CONFLICT,
            "a retry took this request's Idempotency-Key over; this attempt placed nothing",
        )
        .into_response(),
        CompleteInError::Store(err) => store_failed(err),
        other => Problem::internal(other).into_response(),
    }
}

fn log_failed(err: &AppendError) -> Response {
    match err {
        AppendError::Store(err) => store_failed(err),
        other => Problem::internal(other).into_response(),
    }
}

/// Parses and validates a `NewOrder` body: `400` for malformed JSON or a
/// wrong content type, `422` for a well-formed order that breaks a rule.
pub fn parse_new_order(headers: &HeaderMap, body: &[u8]) -> Result<NewOrder, Problem> {
    let order: NewOrder = keel_http::problem::parse_json(headers, body)?;
    order.validate().map_err(|e| unprocessable(e.to_string()))?;
    Ok(order)
}

/// `POST /orders`.
#[utoipa::path(
    post,
    path = "/orders",
    request_body = NewOrder,
    params(
        ("Idempotency-Key" = String, Header, description = "Required: one unique key per order; retries reuse it"),
        ("X-Request-Deadline-Unix-Ms" = Option<i64>, Header, description = "When the caller stops waiting, in Unix milliseconds (capped at 10 s from now)",
            minimum = 0, maximum = 253_402_300_799_999_i64, nullable = false),
        ("traceparent" = Option<String>, Header, nullable = false, description = "W3C trace context; a malformed one is ignored and a new trace starts"),
    ),
    responses(
        (status = 201, description = "Accepted; fulfilment runs asynchronously", body = Order),
        (status = 400, description = "Missing or malformed Idempotency-Key, malformed deadline, or malformed JSON"),
        (status = 409, description = "The same key is still being processed; retry after Retry-After"),
        (status = 413, description = "Body larger than 64 KiB"),
        (status = 415, description = "Not JSON"),
        (status = 422, description = "Invalid order, or the key was used for a different request"),
        (status = 503, description = "Store unavailable, or the commit's outcome unknown (a lost connection); retry with the same key, which finds the order or places it"),
        (status = 504, description = "The X-Request-Deadline-Unix-Ms had passed on arrival, or passed while the order was placed"),
    ),
    tag = "orders"
)]
pub async fn place_order<S: ShopStore>(
    State(state): State<AppState<S>>,
    held: Option<HeldKey>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let new = match parse_new_order(&headers, &body) {
        Ok(order) => order,
        Err(problem) => return problem.into_response(),
    };
    let fault = state
        .demo_faults
        .then(|| {
            headers
                .get(DemoFault::HEADER)?
                .to_str()
                .ok()
                .and_then(DemoFault::parse)
        })
        .flatten();
    let event_id = placed_event_id(&headers);
    let order = Order {
        id: keel_core::id::new_id().to_string(),
        total_cents: new.total_cents(),
        customer_id: new.customer_id,
        currency: new.currency,
        items: new.items,
        status: OrderStatus::Pending,
        created_at: now_rfc3339(),
        delivery_estimate: None,
    };
    // A client that hangs up must not cut the transaction in half: it runs
    // to its end in a task of its own, and a retry under the same key finds
    // the order it placed.
    let inserting = tokio::spawn(keel_core::trace::carried(async move {
        insert(&state, order, held, event_id, fault).await
    }));
    match inserting.await {
        Ok(Ok(response) | Err(response)) => response,
        Err(e) => Problem::internal(e).into_response(),
    }
}

fn created(order: Order) -> Response {
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{}", order.id))],
        Json(order),
    )
        .into_response()
}

/// The id of the `orders.placed` event of the request's Idempotency-Key:
/// the same for every run of the same request, unique per caller and key.
fn placed_event_id(headers: &HeaderMap) -> Option<String> {
    let key = headers.get("idempotency-key")?;
    let caller = headers
        .get(header::AUTHORIZATION)
        .map_or(&b""[..], |v| v.as_bytes());
    Some(placed_event_id_for(caller, key.as_bytes()))
}

/// The `orders.placed` event id of an order placed by `caller` (its
/// `Authorization` header, empty without one) under Idempotency-Key `key`.
/// An invariant checker maps the orders it finds back to the calls that
/// could have placed them with it.
pub fn placed_event_id_for(caller: &[u8], key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let digest = Sha256::new()
        .chain_update(caller)
        .chain_update([0])
        .chain_update(key)
        .finalize();
    let mut id = String::from("order-placed-");
    for byte in &digest[..16] {
        let _ = write!(id, "{byte:02x}");
    }
    id
}

/// Places `order` in one transaction, with the key's `201` when `held`;
/// answers with that `201`, or the problem that stopped it.
async fn insert<S: ShopStore>(
    state: &AppState<S>,
    order: Order,
    held: Option<HeldKey>,
    event_id: Option<String>,
    fault: Option<DemoFault>,
) -> Result<Response, Response> {
    let placed = OrderPlaced {
        order_id: order.id.clone(),
        customer_id: order.customer_id.clone(),
        currency: order.currency.clone(),
        items: order.items.clone(),
        total_cents: order.total_cents,
        demo_fault: fault,
        extra: Default::default(),
    };
    let mut envelope = Envelope::from_event(SOURCE, &placed, EventMeta::new(1))
        .map_err(|e| Problem::internal(e).into_response())?;
    let resolvable = event_id.is_some();
    if let Some(id) = event_id {
        envelope.id = id;
    }
    let store = &state.store;
    let mut tx = store.begin().await.map_err(|e| store_failed(&e))?;
    let inserted = store
        .insert_order(&mut tx, &order, &envelope.id, fault)
        .await
        .map_err(|e| store_failed(&e))?;
    if !inserted {
        return placed_before(store, tx, &envelope.id).await;
    }
    state
        .outbox
        .append(&mut tx, TOPIC, &envelope)
        .await
        .map_err(|e| outbox_failed(&e))?;
    let mut appended = Vec::new();
    if let Some(stream) = customer_stream(&order.customer_id) {
        let data = serde_json::json!({"orderId": order.id, "status": "pending", "totalCents": order.total_cents});
        appended.push(
            state
                .log
                .append(&mut tx, &stream, "order.placed", &data)
                .await
                .map_err(|e| log_failed(&e))?,
        );
    }
    let completion = match &held {
        Some(held) => Some(
            held.complete_in(store, &mut tx, created(order.clone()))
                .await
                .map_err(|e| completion_failed(&e))?,
        ),
        None => None,
    };
    // Once COMMIT is sent, a failure's outcome is unknown. With an event id
    // derived from the Idempotency-Key, the retry resolves it: it finds the
    // order if the commit landed and places it if not (the event id is
    // unique, so a late commit and a retry never both win), so `503` is
    // safe. Without one, a retry would place a second order: say `202`.
    match commit(state, tx, appended).await {
        Ok(()) => {
            state.outbox.notify();
            Ok(completion.map_or_else(|| created(order), Completion::committed))
        }
        Err(err @ StoreError::OutcomeUnknown(_)) => {
            state.outbox.notify();
            if resolvable {
                tracing::warn!(error = %err, order = %order.id,
                    "commit outcome unknown; the client's retry resolves it");
                return Err(store_failed(&err));
            }
            tracing::error!(error = %err, order = %order.id, "commit outcome unknown");
            Err(Problem::new(
                StatusCode::ACCEPTED,
                "the order may have been placed; check GET /orders/{id}",
            )
            .into_response())
        }
        Err(e) => Err(store_failed(&e)),
    }
}

/// The answer to a run of a request whose order an earlier run placed (its
/// commit's outcome was unknown to it, so the key was never completed):
/// that order, read after `tx` is rolled back.
async fn placed_before<S: ShopStore>(
    store: &S,
    tx: S::Tx,
    event_id: &str,
) -> Result<Response, Response> {
    if let Err(err) = store.rollback(tx).await {
        tracing::debug!(error = %err, "rolling back a duplicate order failed; the connection drops it");
    }
    match store.order_by_event(event_id).await {
        Ok(Some(order)) => Ok(created(order)),
        Ok(None) => Err(store_failed(&StoreError::Unavailable(
            "the order placed under this key was not readable yet; retry with the same key".into(),
        ))),
        Err(e) => Err(store_failed(&e)),
    }
}

/// Commits the order's transaction. With the `chaos` feature, the failpoint
/// `keel-orders-commit-lost` stands in for a connection lost during COMMIT:
/// `return(committed)` after the commit landed, `return` before (rolled
/// back); both report the outcome unknown, as the store would.
async fn commit<S: ShopStore>(
    state: &AppState<S>,
    tx: S::Tx,
    appended: Vec<keel_realtime::Appended>,
) -> Result<(), keel_store::StoreError> {
    #[cfg(feature = "chaos")]
    if let Some(landed) = fail::eval("keel-orders-commit-lost", |arg| {
        arg.as_deref() == Some("committed")
    }) {
        if landed {
            state.log.commit(tx, appended).await?;
        } else {
            state.store.rollback(tx).await?;
        }
        return Err(keel_store::StoreError::OutcomeUnknown(
            "failpoint keel-orders-commit-lost".into(),
        ));
    }
    state.log.commit(tx, appended).await
}

/// `GET /orders/{id}`.
#[utoipa::path(
    get,
    path = "/orders/{id}",
    params(("id" = String, Path, description = "The order id (a UUID)", pattern = "^[0-9a-fA-F-]{1,64}$")),
    responses(
        (status = 200, description = "The order", body = Order),
        (status = 400, description = "Malformed id"),
        (status = 404, description = "No such order"),
    ),
    tag = "orders"
)]
pub async fn get_order<S: ShopStore>(
    State(state): State<AppState<S>>,
    Path(id): Path<String>,
) -> Response {
    if !is_order_id(&id) {
        return Problem::bad_request("an order id is a UUID").into_response();
    }
    match state.store.order(&id).await {
        Ok(Some(mut order)) => {
            order.delivery_estimate = state.estimates.for_customer(&order.customer_id).await;
            Json(order).into_response()
        }
        Ok(None) => Problem::not_found(format!("no order {id}")).into_response(),
        Err(e) => store_failed(&e),
    }
}

/// `GET /orders/{id}/shipping-quotes`.
#[utoipa::path(
    get,
    path = "/orders/{id}/shipping-quotes",
    params(
        ("id" = String, Path, description = "The order id (a UUID)", pattern = "^[0-9a-fA-F-]{1,64}$"),
        ("X-Request-Deadline-Unix-Ms" = Option<i64>, Header, description = "When the caller stops waiting, in Unix milliseconds: the carriers are asked within it (and within 250 ms)",
            minimum = 0, maximum = 253_402_300_799_999_i64, nullable = false),
    ),
    responses(
        (status = 200, description = "The quotes that arrived within the budget; `partial` with the `missing` carriers and why when not all did", body = ShippingQuotes),
        (status = 400, description = "Malformed id or deadline"),
        (status = 404, description = "No such order"),
        (status = 503, description = "Store unavailable; retry after Retry-After"),
        (status = 504, description = "The X-Request-Deadline-Unix-Ms had passed on arrival"),
    ),
    tag = "orders"
)]
pub async fn shipping_quotes<S: ShopStore>(
    State(state): State<AppState<S>>,
    Path(id): Path<String>,
) -> Response {
    if !is_order_id(&id) {
        return Problem::bad_request("an order id is a UUID").into_response();
    }
    match state.store.order(&id).await {
        Ok(Some(order)) => {
            Json(state.quotes.for_customer(&order.customer_id).await).into_response()
        }
        Ok(None) => Problem::not_found(format!("no order {id}")).into_response(),
        Err(e) => store_failed(&e),
    }
}

fn is_order_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// Filters of `GET /orders`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct OrderFilter {
    /// Only this customer's orders.
    #[param(pattern = "^[A-Za-z0-9_-]{1,64}$", nullable = false)]
    pub customer_id: Option<String>,
    /// Page size (1 to 100, default 20).
    #[param(minimum = 1, maximum = 100, nullable = false)]
    pub limit: Option<u32>,
    /// The `nextCursor` of the previous page (signed: other values are
    /// refused with `400`).
    #[param(nullable = false)]
    pub cursor: Option<String>,
}

/// A page of orders.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OrderPage {
    /// The orders, oldest first.
    pub items: Vec<Order>,
    /// The cursor of the next page; absent at the end.
    pub next_cursor: Option<String>,
}

/// `GET /orders`: oldest first, keyset pagination with signed cursors.
#[utoipa::path(
    get,
    path = "/orders",
    params(OrderFilter),
    responses(
        (status = 200, description = "A page of orders", body = OrderPage),
        (status = 400, description = "Bad limit, cursor or filter"),
    ),
    tag = "orders"
)]
pub async fn list_orders<S: ShopStore>(
    State(state): State<AppState<S>>,
    page: PageRequest<String, String>,
    Query(filter): Query<std::collections::HashMap<String, String>>,
) -> Response {
    let customer = filter.get("customerId").map(String::as_str);
    if customer.is_some_and(|c| !crate::shop::model::valid_id(c)) {
        return Problem::bad_request(
            "customerId must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'",
        )
        .into_response();
    }
    let after = page.after().map(|c| c.id.as_str());
    let rows = match state
        .store
        .orders_after(after, customer, page.fetch_limit() as usize)
        .await
    {
        Ok(rows) => rows,
        Err(e) => return store_failed(&e),
    };
    match page.page(rows, |o: &Order| Cursor::new(o.id.clone(), o.id.clone())) {
        Ok(page) => Json::<Page<Order>>(page).into_response(),
        Err(e) => Problem::internal(e).into_response(),
    }
}
