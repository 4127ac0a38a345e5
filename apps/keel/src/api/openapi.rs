//! `/openapi.json`: OpenAPI 3.1 for every public route and body, generated
//! from the handlers' annotations (utoipa).
//!
//! Routes served by keel-http components (realtime, health, jobs) are
//! described by the small documented functions below, so the document
//! lists every route the server answers.

use utoipa::OpenApi;

use super::{orders, reports, webhooks};
use crate::shop::model::{
    DemoFault, Item, MissingCarrier, NewOrder, Order, OrderStatus, ShippingQuote, ShippingQuotes,
};

/// `GET /updates`: long poll of a customer's event log.
#[utoipa::path(get, path = "/updates",
    params(
        ("customerId" = String, Query, description = "Whose events"),
        ("after" = Option<i64>, Query, description = "The last seq seen"),
        ("format" = Option<String>, Query, description = "`cloudevents`: the events as a CloudEvents batch (as `Accept: application/cloudevents-batch+json` asks)"),
    ),
    responses(
        (status = 200, description = "Events after the cursor and the new cursor (`{events, cursor, truncated}`); or, asked for CloudEvents, a batch of structured CloudEvents (`application/cloudevents-batch+json`, id `<stream>/<seq>`, the cursor in `Keel-Cursor`, `Keel-Truncated: true` when events were trimmed)"),
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
        ("format" = Option<String>, Query, description = "`cloudevents`: each event's `data:` is a structured CloudEvent"),
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
        orders::shipping_quotes,
        reports::doc_create_report,
        reports::doc_job_status,
        reports::doc_cancel_job,
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
        ShippingQuotes,
        ShippingQuote,
        MissingCarrier,
        reports::Report,
        webhooks::CreateEndpoint,
        webhooks::EndpointView,
        webhooks::DeliveryView,
        ProblemDetails,
    )),
    modifiers(&Security, &ClosedItems, &Rules)
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

/// An error, as every error response carries it (RFC 9457).
#[derive(utoipa::ToSchema)]
#[schema(as = Problem)]
#[allow(dead_code)]
struct ProblemDetails {
    /// A URI naming the problem type (`about:blank`, or
    /// `urn:keel:problem:...`).
    r#type: String,
    /// The status's reason phrase.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What went wrong this time, and what to do.
    detail: Option<String>,
}

/// The `Idempotency-Key` grammar the server checks: 1 to 255 visible ASCII
/// characters, bare (not starting with `"`) or as a Structured Field string
/// with `\"` and `\\` escapes.
pub const IDEMPOTENCY_KEY_PATTERN: &str =
    r#"^(?:[!#-~][!-~]{0,254}|"(?:[!#-\[\]-~]|\\["\\]){1,255}")$"#;

/// Rules stated once for every operation: each error response is a
/// problem document, and every `Idempotency-Key` has one grammar.
struct Rules;

impl utoipa::Modify for Rules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::content::Content;
        use utoipa::openapi::schema::{ObjectBuilder, Ref, Type};
        for item in openapi.paths.paths.values_mut() {
            for operation in operations(item) {
                for response in operation.responses.responses.iter_mut() {
                    let (status, RefOr::T(response)) = response else {
                        continue;
                    };
                    if status.as_str() >= "400" && response.content.is_empty() {
                        response.content.insert(
                            keel_http::problem::PROBLEM_JSON.to_owned(),
                            Content::new(Some(Ref::from_schema_name("Problem"))),
                        );
                    }
                }
                let parameters = operation.parameters.iter_mut().flatten();
                for parameter in parameters.filter(|p| p.name == "Idempotency-Key") {
                    parameter.schema = Some(RefOr::T(
                        ObjectBuilder::new()
                            .schema_type(Type::String)
                            .pattern(Some(IDEMPOTENCY_KEY_PATTERN))
                            .into(),
                    ));
                }
            }
        }
    }
}

/// Every operation of a path.
fn operations(
    item: &mut utoipa::openapi::path::PathItem,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
    ]
    .into_iter()
    .flatten()
}

/// Declares what `NewOrder::validate` enforces and utoipa cannot say: an
/// item has no field beyond `sku`, `qty` and `unitPriceCents` (unknown
/// item fields are kept only inside events, by the tolerant reader).
struct ClosedItems;

impl utoipa::Modify for ClosedItems {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::{AdditionalProperties, Schema};
        let schemas = openapi.components.as_mut().map(|c| &mut c.schemas);
        if let Some(RefOr::T(Schema::Object(item))) = schemas.and_then(|s| s.get_mut("Item")) {
            item.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
        }
    }
}

/// The document as JSON.
pub fn json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}
