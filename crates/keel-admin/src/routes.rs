//! The admin API's routes: thin handlers over [`Admin`]'s operations, with
//! query-string and path errors turned into `400` problems.

use crate::AdminStore;
use axum::Json;
use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;

use super::model::Listing;
use super::{
    ActionJson, Admin, AdminError, AdminSession, BreakerJson, DeadLetterJson, DeadLetterQuery,
    LagJson, ParkedJson, ParkedQuery, SagaJson, SagaQuery, SummaryJson,
};
use crate::history::{HistoryJson, HistoryQuery};

pub(crate) type Reply<T> = Result<Json<T>, AdminError>;

impl<S> Admin<S>
where
    S: AdminStore,
{
    /// The admin API under `/admin/api` (see the [module docs](super)),
    /// behind [`auth_layer`](Self::auth_layer). Merge it into the app's
    /// router.
    pub fn router(&self) -> Router {
        let login = Router::new()
            .route("/admin/api/login", post(login::<S>))
            .route_layer(self.access().login_layer(API_CSP))
            .with_state(self.clone());
        let routes = Router::new()
            .route("/admin/api/logout", post(logout::<S>))
            .route("/admin/api/summary", get(summary::<S>))
            .route("/admin/api/dead-letters", get(dead_letters::<S>))
            .route(
                "/admin/api/dead-letters/replay-matching",
                post(replay_matching::<S>),
            )
            .route("/admin/api/dead-letters/{id}", get(dead_letter::<S>))
            .route("/admin/api/dead-letters/{id}/replay", post(replay::<S>))
            .route("/admin/api/dead-letters/{id}/discard", post(discard::<S>))
            .route("/admin/api/outbox/parked", get(parked::<S>))
            .route("/admin/api/outbox/parked/{id}", get(parked_row::<S>))
            .route(
                "/admin/api/outbox/parked/{id}/replay",
                post(replay_parked::<S>),
            )
            .route(
                "/admin/api/outbox/parked/{id}/discard",
                post(discard_parked::<S>),
            )
            .route("/admin/api/sagas", get(sagas::<S>))
            .route("/admin/api/sagas/{id}", get(saga::<S>))
            .route("/admin/api/sagas/{id}/retry", post(retry::<S>))
            .route("/admin/api/sagas/{id}/cancel", post(cancel::<S>))
            .route(
                "/admin/api/sagas/{id}/confirm-not-applied",
                post(confirm_not_applied::<S>),
            )
            .route("/admin/api/breakers", get(breakers::<S>))
            .route("/admin/api/lag", get(lag::<S>))
            .route("/admin/api/history", get(history::<S>));
        #[cfg(feature = "webhooks")]
        let routes = crate::webhooks::routes(routes);
        routes
            .route_layer(self.auth_layer())
            .with_state(self.clone())
            .merge(login)
    }
}

/// The policy of JSON answers: nothing may load or frame them.
const API_CSP: &str = "default-src 'none'; frame-ancestors 'none'";

/// `POST /admin/api/login`: a session and its CSRF token, for clients that
/// act without the token in every request (the CLI on a loopback server
/// without a token). With a token configured it must come as a bearer
/// token.
async fn login<S: AdminStore>(
    State(admin): State<Admin<S>>,
    ConnectedIp(ip): ConnectedIp,
    headers: HeaderMap,
) -> Response {
    let access = admin.access();
    if access.token().is_required() {
        let presented = keel_http::access::bearer(&headers).unwrap_or_default();
        if !access.token().verify(presented) {
            access.throttle().fail(ip);
            return AdminError::Unauthorized.into_response();
        }
    }
    let mut cookie = HeaderMap::new();
    let session = access.start_session(&headers, &mut cookie);
    let body = Json(serde_json::json!({"csrf": session.csrf, "expiresAt": session.expires_at}));
    (StatusCode::CREATED, cookie, body).into_response()
}

/// `POST /admin/api/logout`: ends the request's session.
async fn logout<S: AdminStore>(
    State(admin): State<Admin<S>>,
    session: Option<Extension<AdminSession>>,
    headers: HeaderMap,
) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    let session = session.map(|Extension(s)| s);
    admin
        .access()
        .end_session(session.as_ref(), &headers, response.headers_mut());
    response
}

/// The client address, when the server recorded it.
pub(crate) struct ConnectedIp(pub(crate) Option<std::net::IpAddr>);

impl<St: Sync> axum::extract::FromRequestParts<St> for ConnectedIp {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &St,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self(keel_http::access::client_ip(&parts.extensions)))
    }
}

pub(crate) fn query<T: DeserializeOwned>(
    q: Result<Query<T>, QueryRejection>,
) -> Result<T, AdminError> {
    q.map(|Query(q)| q)
        .map_err(|e| AdminError::bad_request(format!("bad query string: {}", e.body_text())))
}

async fn summary<S: AdminStore>(State(admin): State<Admin<S>>) -> Reply<SummaryJson> {
    Ok(Json(admin.summary().await?))
}

async fn dead_letters<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<DeadLetterQuery>, QueryRejection>,
) -> Reply<Listing<DeadLetterJson>> {
    Ok(Json(admin.dead_letters(&query(q)?).await?.into()))
}

async fn replay_matching<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<DeadLetterQuery>, QueryRejection>,
) -> Reply<ActionJson> {
    Ok(Json(admin.replay_dead_letters(&query(q)?).await?))
}

async fn dead_letter<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<DeadLetterJson> {
    Ok(Json(admin.dead_letter(&id).await?))
}

async fn replay<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ActionJson> {
    Ok(Json(admin.replay_dead_letter(&id).await?))
}

async fn discard<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ActionJson> {
    Ok(Json(admin.discard_dead_letter(&id).await?))
}

async fn parked<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<ParkedQuery>, QueryRejection>,
) -> Reply<Listing<ParkedJson>> {
    Ok(Json(admin.parked_outbox(&query(q)?).await?.into()))
}

async fn parked_row<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ParkedJson> {
    Ok(Json(admin.parked_outbox_row(&id).await?))
}

async fn replay_parked<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ActionJson> {
    Ok(Json(admin.replay_parked(&id).await?))
}

async fn discard_parked<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ActionJson> {
    Ok(Json(admin.discard_parked(&id).await?))
}

async fn sagas<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<SagaQuery>, QueryRejection>,
) -> Reply<Listing<SagaJson>> {
    Ok(Json(admin.sagas(&query(q)?).await?.into()))
}

async fn saga<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<SagaJson> {
    Ok(Json(admin.saga(&id).await?))
}

async fn retry<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<SagaJson> {
    Ok(Json(admin.retry_saga(&id).await?))
}

async fn confirm_not_applied<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<SagaJson> {
    Ok(Json(admin.confirm_not_applied(&id).await?))
}

async fn cancel<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<SagaJson> {
    Ok(Json(admin.cancel_saga(&id).await?))
}

async fn breakers<S: AdminStore>(State(admin): State<Admin<S>>) -> Json<Listing<BreakerJson>> {
    Json(admin.breakers().into())
}

async fn lag<S: AdminStore>(State(admin): State<Admin<S>>) -> Reply<LagJson> {
    Ok(Json(admin.lag().await?))
}

async fn history<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<HistoryQuery>, QueryRejection>,
) -> Reply<HistoryJson> {
    let q = query(q)?;
    let history = admin
        .history()
        .ok_or(AdminError::NotConfigured("a history"))?;
    Ok(Json(history.snapshot(&q)))
}
