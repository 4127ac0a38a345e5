//! `/openapi.json`: OpenAPI 3.1 for every public route and body, generated
//! from the handlers' annotations (utoipa).
//!
//! Routes served by keel-http components (realtime, health, jobs) are
//! described by the small documented functions below, so the document
//! lists every route the server answers.

use utoipa::OpenApi;

use super::{orders, reports, webhooks};
use crate::shop::model::{DemoFault, Item, NewOrder, Order, OrderStatus};

/// `GET /updates`: long poll of a customer's event log.
#[utoipa::path(get, path = "/updates",
    params(
        ("customerId" = String, Query, description = "Whose events"),
        ("after" = Option<i64>, Query, description = "The last seq seen"),
    ),
    responses(
        (status = 200, description = "Events after the cursor, and the new cursor"),
        (status = 204, description = "Nothing new within the poll timeout (25 s), or half a second before the request's deadline (at most 10 s, or the X-Request-Deadline-Unix-Ms sent)"),
        (status = 400, description = "Bad cursor"),
        (status = 401, description = "No or bad customerId"),
        (status = 503, description = "The client holds the most long-lived connections allowed, or the server is draining (Retry-After)"),
    ), tag = "realtime")]
pub fn doc_updates() {}

/// `GET /stream`: Server-Sent Events of a customer's event log.
#[utoipa::path(get, path = "/stream",
    params(
        ("customerId" = String, Query, description = "Whose events"),
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this seq"),
    ),
    responses(
        (status = 200, description = "text/event-stream"),
        (status = 401, description = "No or bad customerId"),
        (status = 503, description = "The client holds the most long-lived connections allowed (Retry-After)"),
    ), tag = "realtime")]
pub fn doc_stream() {}

/// `GET /ws`: WebSocket (subprotocol `keel.v1`) over a customer's event log.
#[utoipa::path(get, path = "/ws",
    params(("customerId" = String, Query, description = "Whose events")),
    responses(
        (status = 101, description = "Switching protocols"),
        (status = 400, description = "Not a WebSocket handshake"),
        (status = 401, description = "No or bad customerId"),
        (status = 403, description = "An Origin not on the allow-list (the server's own, plus --ws-allowed-origins)"),
    ), tag = "realtime")]
pub fn doc_ws() {}

/// `GET /livez`.
#[utoipa::path(get, path = "/livez", responses((status = 200, description = "The process is alive")), tag = "health")]
pub fn doc_livez() {}

/// `GET /readyz`.
#[utoipa::path(get, path = "/readyz", responses(
    (status = 200, description = "Ready for traffic"),
    (status = 503, description = "Not ready (draining, store unavailable)"),
), tag = "health")]
pub fn doc_readyz() {}

/// `GET /debug/deep`.
#[utoipa::path(get, path = "/debug/deep", responses(
    (status = 200, description = "Each dependency's status and latency"),
    (status = 401, description = "Unless --public-metrics: the admin token is required"),
    (status = 403, description = "A Host the admin does not answer to"),
), tag = "health")]
pub fn doc_deep() {}

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", responses(
    (status = 200, description = "Prometheus text exposition"),
    (status = 401, description = "Unless --public-metrics: the admin token is required"),
    (status = 403, description = "A Host the admin does not answer to"),
), tag = "health")]
pub fn doc_metrics() {}

/// `GET /openapi.json`.
#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "This document")), tag = "health")]
pub fn doc_openapi() {}

/// The API description.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Keel reference shop",
        description = "Orders, async reports, realtime updates and webhooks of the Keel reference system. Errors are application/problem+json (RFC 9457)."
    ),
    paths(
        orders::place_order,
        orders::list_orders,
        orders::get_order,
        reports::doc_create_report,
        reports::doc_job_status,
        reports::get_report,
        doc_updates,
        doc_stream,
        doc_ws,
        webhooks::create_endpoint,
        webhooks::list_endpoints,
        webhooks::list_deliveries,
        webhooks::resend,
        webhooks::delete_endpoint,
        webhooks::inbound,
        doc_livez,
        doc_readyz,
        doc_deep,
        doc_metrics,
        doc_openapi,
    ),
    components(schemas(
        NewOrder,
        Item,
        Order,
        OrderStatus,
        DemoFault,
        orders::OrderPage,
        reports::Report,
        webhooks::CreateEndpoint,
        webhooks::EndpointView,
        webhooks::DeliveryView,
    )),
    modifiers(&Security)
)]
pub struct ApiDoc;

/// Declares the `api_key` scheme webhook management requires: a tenant's
/// key as a bearer token.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A tenant's API key (`keel serve --api-key tenant:key`)",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as JSON.
pub fn json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}
