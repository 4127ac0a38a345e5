//! Webhook routes: endpoints (`POST`/`GET /webhook-endpoints`,
//! `DELETE /webhook-endpoints/{id}`), their delivery log, manual re-send,
//! and verified inbound webhooks.
//!
//! Managing endpoints needs a tenant's API key (`ApiKeyLayer`), and every
//! route sees only the caller's own endpoints and deliveries: another
//! tenant's id answers `404`, exactly like an id that does not exist. Each
//! tenant may register at most `max_per_tenant` endpoints, so one event
//! fans out to a bounded number of requests.

use axum::Json;
use axum::body::Bytes;
use std::sync::Arc;

use axum::extract::{Extension, FromRef, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use keel_http::access::Tenant;
use keel_http::problem::Problem;
use keel_messaging::version_guard::{Freshness, VersionGuard};
use keel_store::StoreError;
use keel_webhooks::{
    DeliveryFilter, Endpoints, NewEndpoint, VerifiedWebhook, WebhookDelivery, WebhookEndpoint,
    WebhookError, WebhookFormat, WebhookReceiver, WebhookRejection,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::shop::ShopStore;

/// The webhook routes' state.
pub struct WebhookApi<S: ShopStore> {
    /// Endpoints and the delivery log.
    pub endpoints: Endpoints<S>,
    /// Where inbound webhooks' entity versions are recorded.
    pub store: S,
    /// Verifies inbound webhooks.
    pub receiver: WebhookReceiver,
    /// Endpoints one tenant may register.
    pub max_per_tenant: usize,
    /// Creations one at a time, so two at once cannot both pass the limit
    /// (in this process).
    pub creating: Arc<tokio::sync::Mutex<()>>,
}

impl<S: ShopStore> Clone for WebhookApi<S> {
    fn clone(&self) -> Self {
        Self {
            endpoints: self.endpoints.clone(),
            store: self.store.clone(),
            receiver: self.receiver.clone(),
            max_per_tenant: self.max_per_tenant,
            creating: Arc::clone(&self.creating),
        }
    }
}

/// The default of endpoints per tenant: 10.
pub const DEFAULT_MAX_ENDPOINTS_PER_TENANT: usize = 10;

/// A new webhook endpoint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateEndpoint {
    /// Where to send: an absolute http or https URL of at most 2048
    /// characters. Addresses inside the network (loopback, private, link
    /// local) are refused with `422`.
    #[schema(max_length = 2048)]
    pub url: String,
    /// For humans: at most 1024 characters.
    #[serde(default)]
    #[schema(max_length = 1024)]
    pub description: String,
    /// Event types to receive (`order.completed`, `order.*`, or `*`), at
    /// most 100; empty: all.
    #[serde(default)]
    #[schema(max_items = 100, inline)]
    pub event_types: Vec<EventTypeFilter>,
    /// How deliveries go on the wire (default `standard-webhooks`): the
    /// Standard Webhooks JSON payload, a CloudEvents 1.0 event in structured
    /// mode (`application/cloudevents+json`), or CloudEvents attributes as
    /// `ce-*` headers with `data` as the body. All are signed alike.
    #[serde(default)]
    #[schema(value_type = String, pattern = "^(standard-webhooks|cloudevents-structured|cloudevents-binary|standard-webhooks-thin)$")]
    pub format: WebhookFormat,
}

/// An event type (`order.completed`), a prefix (`order.*`) or `*`: visible
/// ASCII without `*` but for the trailing `.*`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(transparent)]
#[schema(value_type = String, pattern = r"^(\*|[!-)+-~]{1,255}(\.\*)?)$")]
pub struct EventTypeFilter(String);

/// An endpoint as the API shows it (secrets are shown once, at creation).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointView {
    /// The endpoint id.
    pub id: String,
    /// Its URL.
    pub url: String,
    /// Its description.
    pub description: String,
    /// Its event types.
    pub event_types: Vec<String>,
    /// Whether deliveries are sent.
    pub enabled: bool,
    /// Why it was disabled.
    pub disabled_reason: Option<String>,
    /// How its deliveries go on the wire.
    #[schema(value_type = String, pattern = "^(standard-webhooks|cloudevents-structured|cloudevents-binary|standard-webhooks-thin)$")]
    pub format: WebhookFormat,
    /// The signing secret: only in the answer to `POST`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

impl EndpointView {
    fn from(e: WebhookEndpoint, secret: Option<String>) -> Self {
        Self {
            id: e.id,
            url: e.url,
            description: e.description,
            event_types: e.event_types,
            enabled: e.enabled,
            disabled_reason: e.disabled_reason,
            format: e.format,
            secret,
        }
    }
}

/// One delivery of an event to an endpoint.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    /// The delivery id.
    pub id: i64,
    /// The endpoint.
    pub endpoint_id: String,
    /// The event id (`webhook-id`).
    pub event_id: String,
    /// The event type.
    pub event_type: String,
    /// `pending`, `succeeded`, `failed`, ...
    pub status: String,
    /// Attempts so far.
    pub attempts: u32,
    /// When the next attempt is due (RFC 3339).
    pub next_attempt_at: String,
}

impl From<WebhookDelivery> for DeliveryView {
    fn from(d: WebhookDelivery) -> Self {
        Self {
            id: d.id,
            endpoint_id: d.endpoint_id,
            event_id: d.event_id,
            event_type: d.event_type,
            status: d.status.as_str().to_owned(),
            attempts: d.attempts,
            next_attempt_at: d.next_attempt_at.to_rfc3339(),
        }
    }
}

/// Filters of the delivery log.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DeliveryParams {
    /// At most this many (1 to 100, default 50).
    #[param(minimum = 1, maximum = 100, nullable = false)]
    pub limit: Option<usize>,
    /// Only deliveries with ids below this (paging back).
    #[param(nullable = false)]
    pub before: Option<i64>,
}

/// The one mapping of webhook errors to problems.
pub fn problem(err: WebhookError) -> Response {
    match err {
        WebhookError::EndpointNotFound(id) => {
            Problem::not_found(format!("no webhook endpoint {id}")).into_response()
        }
        WebhookError::DeliveryNotFound(id) => {
            Problem::not_found(format!("no delivery {id}")).into_response()
        }
        WebhookError::Conflict(why) => Problem::new(StatusCode::CONFLICT, why).into_response(),
        e @ (WebhookError::Invalid { .. }
        | WebhookError::Url(_)
        | WebhookError::PayloadTooLarge { .. }) => {
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).into_response()
        }
        WebhookError::Store(e) => Problem::from_store(&e).into_response(),
        e => Problem::internal(e).into_response(),
    }
}

/// `POST /webhook-endpoints`.
#[utoipa::path(post, path = "/webhook-endpoints", request_body = CreateEndpoint,
    responses(
        (status = 201, description = "Registered; the secret is shown once", body = EndpointView),
        (status = 400, description = "Malformed JSON"),
        (status = 401, description = "No or unknown API key"),
        (status = 409, description = "The tenant has as many endpoints as allowed"),
        (status = 415, description = "Not JSON"),
        (status = 422, description = "A refused URL (internal address) or bad event types"),
    ), security(("api_key" = [])), tag = "webhooks")]
pub async fn create_endpoint<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: CreateEndpoint = match keel_http::problem::parse_json(&headers, &body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let _one_at_a_time = api.creating.lock().await;
    match api.endpoints.list_of(tenant.as_str()).await {
        Ok(owned) if owned.len() >= api.max_per_tenant => {
            return Problem::new(
                StatusCode::CONFLICT,
                format!(
                    "tenant {tenant} has {} webhook endpoints, the most allowed: delete one first",
                    owned.len()
                ),
            )
            .typed("endpoint_limit")
            .into_response();
        }
        Ok(_) => {}
        Err(e) => return problem(e),
    }
    let new = NewEndpoint::new(req.url)
        .description(req.description)
        .event_types(req.event_types.into_iter().map(|f| f.0))
        .format(req.format)
        .tenant(tenant.as_str());
    match api.endpoints.create(new).await {
        Ok((endpoint, secret)) => (
            StatusCode::CREATED,
            Json(EndpointView::from(
                endpoint,
                Some(secret.expose().to_owned()),
            )),
        )
            .into_response(),
        Err(e) => problem(e),
    }
}

/// `GET /webhook-endpoints`.
#[utoipa::path(get, path = "/webhook-endpoints",
    responses(
        (status = 200, description = "The caller's endpoints", body = Vec<EndpointView>),
        (status = 401, description = "No or unknown API key"),
    ), security(("api_key" = [])), tag = "webhooks")]
pub async fn list_endpoints<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Extension(tenant): Extension<Tenant>,
) -> Response {
    match api.endpoints.list_of(tenant.as_str()).await {
        Ok(list) => Json(
            list.into_iter()
                .map(|e| EndpointView::from(e, None))
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(e) => problem(e),
    }
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 255 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// `GET /webhook-endpoints/{id}/deliveries`.
#[utoipa::path(get, path = "/webhook-endpoints/{id}/deliveries",
    params(("id" = String, Path, description = "The endpoint id", pattern = "^[!-~]{1,255}$"), DeliveryParams),
    responses(
        (status = 200, description = "Deliveries, newest first", body = Vec<DeliveryView>),
        (status = 400, description = "Bad filter"),
        (status = 401, description = "No or unknown API key"),
        (status = 404, description = "No such endpoint of the caller's"),
    ), security(("api_key" = [])), tag = "webhooks")]
pub async fn list_deliveries<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    params: Result<Query<DeliveryParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(params)) = params else {
        return Problem::bad_request("limit and before must be integers").into_response();
    };
    if !valid_id(&id) {
        return Problem::bad_request("malformed endpoint id").into_response();
    }
    let limit = params.limit.unwrap_or(50);
    if !(1..=100).contains(&limit) {
        return Problem::bad_request("limit must be 1 to 100").into_response();
    }
    if let Err(e) = api.endpoints.get_of(tenant.as_str(), &id).await {
        return problem(e);
    }
    let filter = DeliveryFilter {
        endpoint_id: Some(id),
        before_id: params.before,
        limit: Some(limit),
        ..DeliveryFilter::default()
    };
    match api.endpoints.deliveries(&filter).await {
        Ok(list) => {
            Json(list.into_iter().map(DeliveryView::from).collect::<Vec<_>>()).into_response()
        }
        Err(e) => problem(e),
    }
}

/// `POST /deliveries/{id}/resend`.
#[utoipa::path(post, path = "/deliveries/{id}/resend",
    params(("id" = i64, Path, description = "The delivery id")),
    responses(
        (status = 202, description = "Queued again with the same webhook-id"),
        (status = 400, description = "Malformed id"),
        (status = 401, description = "No or unknown API key"),
        (status = 404, description = "No such delivery of the caller's"),
        (status = 409, description = "Being attempted now, or its endpoint is disabled"),
    ), security(("api_key" = [])), tag = "webhooks")]
pub async fn resend<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return Problem::bad_request("a delivery id is an integer").into_response();
    };
    let owned = match api.endpoints.delivery(id).await {
        Ok(delivery) => api
            .endpoints
            .get_of(tenant.as_str(), &delivery.endpoint_id)
            .await
            .is_ok(),
        Err(e) => return problem(e),
    };
    if !owned {
        return problem(WebhookError::DeliveryNotFound(id));
    }
    match api.endpoints.resend(id).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({"resent": id})),
        )
            .into_response(),
        Err(e) => problem(e),
    }
}

/// `DELETE /webhook-endpoints/{id}`: the endpoint and its deliveries stop.
#[utoipa::path(delete, path = "/webhook-endpoints/{id}",
    params(("id" = String, Path, description = "The endpoint id", pattern = "^[!-~]{1,255}$")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "Malformed id"),
        (status = 401, description = "No or unknown API key"),
        (status = 404, description = "No such endpoint of the caller's"),
    ), security(("api_key" = [])), tag = "webhooks")]
pub async fn delete_endpoint<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    if !valid_id(&id) {
        return Problem::bad_request("malformed endpoint id").into_response();
    }
    if let Err(e) = api.endpoints.get_of(tenant.as_str(), &id).await {
        return problem(e);
    }
    match api.endpoints.delete(&id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => problem(e),
    }
}

/// `POST /webhooks/inbound/{source}`: a webhook from a partner, verified
/// (Standard Webhooks signature over the raw body, timestamp within 5
/// minutes, deduped on its id) and acknowledged at once.
///
/// Webhooks arrive out of order: a sender retries one while sending the
/// next, or sends from several workers. A payload that names its entity
/// (`subject`, else `data.id`) and its version (`data.version`, growing
/// per entity) passes the entity version guard: the newest version per
/// source and entity is recorded, and one not newer than what was applied
/// is acknowledged (the sender must not retry it) but not applied, and the
/// answer says `"stale": true`.
#[utoipa::path(post, path = "/webhooks/inbound/{source}",
    params(
        ("source" = String, Path, description = "Who sends it", pattern = "^[a-z0-9_-]{1,64}$"),
        ("webhook-id" = String, Header, description = "The message id (Standard Webhooks); duplicates are acknowledged, not processed again"),
        ("webhook-timestamp" = String, Header, description = "Unix seconds; more than 5 minutes away is refused"),
        ("webhook-signature" = String, Header, description = "`v1,<base64 HMAC-SHA256>` over `id.timestamp.body`, space-separated"),
    ),
    request_body(content = Object, description = "The signed JSON body; `subject` (or `data.id`) and `data.version` put it in order with the entity's others", content_type = "application/json"),
    responses(
        (status = 200, description = "Verified and accepted, a duplicate, or older than what was applied (`stale`)"),
        (status = 400, description = "Missing/malformed signature headers, stale timestamp, bad JSON, bad source"),
        (status = 401, description = "The signature does not verify"),
        (status = 413, description = "Body too large"),
        (status = 503, description = "The entity's version could not be recorded; send it again"),
    ), tag = "webhooks")]
pub async fn inbound<S: ShopStore>(
    State(api): State<WebhookApi<S>>,
    Path(source): Path<String>,
    hook: Result<VerifiedWebhook, WebhookRejection>,
) -> Response {
    if source.is_empty()
        || source.len() > 64
        || !source
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return Problem::bad_request("source must be 1 to 64 characters of a-z, 0-9, '_' or '-'")
            .into_response();
    }
    let hook = match hook {
        Ok(hook) => hook,
        Err(rejection) => return rejection.into_response(),
    };
    tracing::info!(source, id = %hook.id, "inbound webhook verified");
    let mut answer = serde_json::json!({"received": true, "source": source, "id": hook.id});
    if let Some((entity, version)) = entity_version(&hook.payload) {
        match admit_in_order(&api.store, &source, &entity, version).await {
            Ok(freshness) => answer["stale"] = (freshness == Freshness::Stale).into(),
            Err(e) => {
                tracing::warn!(source, id = %hook.id, error = %e, "could not record an inbound webhook's version");
                // Its retry carries the same id: it must not be answered
                // as a duplicate of a webhook that was not applied.
                hook.release();
                return Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the entity's version could not be recorded; send it again",
                )
                .into_response();
            }
        }
    }
    (StatusCode::OK, Json(answer)).into_response()
}

/// The entity a payload is about (`subject`, else `data.id`) and its
/// version (`data.version`), if it names both.
fn entity_version(payload: &serde_json::Value) -> Option<(String, u64)> {
    let entity = payload
        .get("subject")
        .or_else(|| payload.get("data")?.get("id"))?
        .as_str()
        .filter(|e| !e.is_empty() && e.len() <= 256)?;
    // Stored as a signed 64-bit number; a larger one is not a version.
    let version = payload
        .get("data")?
        .get("version")?
        .as_u64()
        .filter(|v| i64::try_from(*v).is_ok())?;
    Some((entity.to_owned(), version))
}

/// Records `version` of `entity` from `source` if it is newer than the
/// one applied, in a transaction of its own. One scope for every source
/// (the path is not signed), with the source in the entity's key.
async fn admit_in_order<S: ShopStore>(
    store: &S,
    source: &str,
    entity: &str,
    version: u64,
) -> Result<Freshness, StoreError> {
    let guard = VersionGuard::new(store.clone(), "inbound-webhooks");
    let mut tx = store.begin().await?;
    let freshness = guard
        .admit_version(&mut tx, &format!("{source}/{entity}"), version)
        .await?;
    store.commit(tx).await?;
    Ok(freshness)
}

impl<S: ShopStore> FromRef<WebhookApi<S>> for WebhookReceiver {
    fn from_ref(api: &WebhookApi<S>) -> Self {
        api.receiver.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_format_grammar_names_every_format() {
        // The `format` fields' `pattern` (utoipa takes only a literal there).
        const FORMAT_PATTERN: &str = "^(standard-webhooks|cloudevents-structured|cloudevents-binary|standard-webhooks-thin)$";
        let names: Vec<&str> = WebhookFormat::ALL.iter().map(|f| f.as_str()).collect();
        assert_eq!(FORMAT_PATTERN, format!("^({})$", names.join("|")));
        let doc = crate::api::openapi::json();
        assert_eq!(
            doc.matches(FORMAT_PATTERN).count(),
            2,
            "both format fields carry it"
        );
    }
}
