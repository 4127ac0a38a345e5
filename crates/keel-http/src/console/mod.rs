//! The operator console: server-rendered HTML at `/console`, kept live over
//! SSE, with a button for every lever the admin API offers.
//!
//! An incident is the worst time to install a dashboard, so the console is
//! part of the server: no front-end build, no external assets, no framework
//! — plain HTML forms that work without JavaScript, and twenty lines of
//! script that open an `EventSource` on `/console/events` and swap in each
//! section (sagas, dead letters, parked outbox rows, webhook deliveries,
//! breakers, lag) when
//! its content changes (checked every second by default).
//!
//! Every button is a form POSTing to a console route that calls the same
//! [`Admin`] operation as the JSON API (and the `keel` CLI), then answers
//! `303` back to the page with a notice. The console sits behind the same
//! token: `/console/login` takes it once and sets an `HttpOnly`,
//! `SameSite=Strict` session cookie, and every POST must come from the
//! console's own origin (see [`crate::admin::same_origin`]).
//!
//! Elements carry stable attributes for tests and scripts:
//! `data-saga-id`, `data-dead-letter-id`, `data-parked-id`, `data-delivery-id`,
//! `data-status`, `data-action="retry|cancel|replay|discard|resend"`.
//!
//! ```no_run
//! # async fn demo(store: keel_sqlite::store::SqliteStore) {
//! use keel_http::admin::Admin;
//! use keel_http::console::Console;
//!
//! let admin = Admin::builder(store).build();
//! let app = admin.router().merge(Console::new(admin).router());
//! # let _ = app; }
//! ```

mod html;
mod page;
mod render;

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use futures_util::Stream;
use keel_messaging::MessagingStore;
use keel_messaging::store::{SagaStatus, WebhookStore};
use serde::Deserialize;
use sha2::{Digest, Sha256};

pub use html::escape;

use crate::admin::{
    ActionJson, Admin, AdminAuthLayer, AdminError, DeadLetterQuery, DeliveryQuery, ParkedQuery,
    SESSION_COOKIE, SagaQuery, same_origin,
};

/// How often the live stream looks for changes by default: every second.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(1);

/// How many rows each section shows by default: 50.
pub const DEFAULT_ROWS: usize = 50;

/// The console over an [`Admin`]. Cheap to clone. Defaults: refresh every
/// [`DEFAULT_REFRESH`], [`DEFAULT_ROWS`] rows per section, titled "Keel
/// console".
pub struct Console<S> {
    admin: Admin<S>,
    refresh: Duration,
    rows: usize,
    title: String,
}

impl<S> Clone for Console<S> {
    fn clone(&self) -> Self {
        Self {
            admin: self.admin.clone(),
            refresh: self.refresh,
            rows: self.rows,
            title: self.title.clone(),
        }
    }
}

impl<S> std::fmt::Debug for Console<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("refresh", &self.refresh)
            .field("rows", &self.rows)
            .field("title", &self.title)
            .finish_non_exhaustive()
    }
}

impl<S> Console<S>
where
    S: MessagingStore + WebhookStore,
{
    /// The console over `admin`, behind its token.
    pub fn new(admin: Admin<S>) -> Self {
        Self {
            admin,
            refresh: DEFAULT_REFRESH,
            rows: DEFAULT_ROWS,
            title: "Keel console".to_owned(),
        }
    }

    /// How often the live stream looks for changes (at least 100 ms).
    pub fn refresh_interval(mut self, every: Duration) -> Self {
        self.refresh = every.max(Duration::from_millis(100));
        self
    }

    /// How many rows each section shows (1 to 1000).
    pub fn rows(mut self, rows: usize) -> Self {
        self.rows = rows.clamp(1, crate::admin::MAX_LIMIT);
        self
    }

    /// The page title (e.g. the service's name).
    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The console's routes under `/console`. Merge them into the app's
    /// router next to [`Admin::router`].
    pub fn router(&self) -> Router {
        let login = AdminAuthLayer::new(self.admin.token().clone()).redirect_to("/console/login");
        let protected = Router::new()
            .route("/console", get(console_page::<S>))
            .route("/console/", get(|| async { Redirect::to("/console") }))
            .route("/console/events", get(events::<S>))
            .route("/console/sagas/{id}/retry", post(retry_saga::<S>))
            .route("/console/sagas/{id}/cancel", post(cancel_saga::<S>))
            .route(
                "/console/dead-letters/{id}/replay",
                post(replay_letter::<S>),
            )
            .route(
                "/console/dead-letters/{id}/discard",
                post(discard_letter::<S>),
            )
            .route(
                "/console/outbox/parked/{id}/replay",
                post(replay_parked::<S>),
            )
            .route(
                "/console/outbox/parked/{id}/discard",
                post(discard_parked::<S>),
            )
            .route(
                "/console/webhook-deliveries/{id}/resend",
                post(resend_delivery::<S>),
            )
            .route_layer(login)
            .with_state(self.clone());
        let open = Router::new()
            .route(
                "/console/login",
                get(login_page::<S>).post(login_submit::<S>),
            )
            .route("/console/logout", post(logout))
            .with_state(self.clone());
        protected.merge(open)
    }

    /// Every section's HTML, in page order.
    async fn sections(&self) -> Vec<(&'static str, String)> {
        let admin = &self.admin;
        let rows = self.rows.to_string();
        let summary = render::or_error(admin.summary().await, |s| render::summary(&s));
        let sagas = match (admin.saga_counts().await, self.active_sagas(&rows).await) {
            (Ok(counts), Ok(list)) => render::sagas(&counts, &list),
            (Err(e), _) | (_, Err(e)) => render::or_error(Err::<(), _>(e), |()| String::new()),
        };
        let letters = DeadLetterQuery {
            limit: Some(rows.clone()),
            ..DeadLetterQuery::default()
        };
        let letters = render::or_error(admin.dead_letters(&letters).await, |l| {
            render::dead_letters(&l)
        });
        let parked = ParkedQuery {
            limit: Some(rows.clone()),
            ..ParkedQuery::default()
        };
        let parked = render::or_error(admin.parked_outbox(&parked).await, |p| {
            render::parked_outbox(&p)
        });
        let deliveries = DeliveryQuery {
            limit: Some(rows),
            ..DeliveryQuery::default()
        };
        let deliveries = render::or_error(admin.deliveries(&deliveries, true).await, |d| {
            render::deliveries(&d)
        });
        let breakers = render::breakers(&admin.breakers());
        let lag = render::or_error(admin.lag().await, |l| render::lag(&l));
        let html = [summary, sagas, letters, parked, deliveries, breakers, lag];
        render::SECTIONS.into_iter().zip(html).collect()
    }

    /// Stuck sagas first, then compensating, then running.
    async fn active_sagas(&self, rows: &str) -> Result<Vec<crate::admin::SagaJson>, AdminError> {
        let mut all = Vec::new();
        for status in [
            SagaStatus::Stuck,
            SagaStatus::Compensating,
            SagaStatus::Running,
        ] {
            let query = SagaQuery {
                limit: Some(rows.to_owned()),
                ..SagaQuery::status(status)
            };
            all.extend(self.admin.sagas(&query).await?);
        }
        all.truncate(self.rows);
        Ok(all)
    }
}

fn hash(html: &str) -> String {
    hex::encode(&Sha256::digest(html.as_bytes())[..8])
}

#[derive(Debug, Default, Deserialize)]
struct NoticeQuery {
    notice: Option<String>,
    error: Option<String>,
}

async fn console_page<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    notice: Result<Query<NoticeQuery>, axum::extract::rejection::QueryRejection>,
) -> Html<String> {
    let notice = notice.map(|Query(q)| q).unwrap_or_default();
    let notice = match (&notice.error, &notice.notice) {
        (Some(e), _) => Some((e.as_str(), true)),
        (None, Some(n)) => Some((n.as_str(), false)),
        (None, None) => None,
    };
    let sections = console.sections().await;
    let hashes: Vec<String> = sections.iter().map(|(_, h)| hash(h)).collect();
    let sections: Vec<page::Section<'_>> = sections
        .iter()
        .zip(&hashes)
        .map(|((id, html), hash)| page::Section { id, hash, html })
        .collect();
    let logout = console.admin.token().is_required();
    Html(page::console(&console.title, notice, &sections, logout))
}

/// The live stream: a `sections` event with `{id: {hash, html}}` for every
/// section whose HTML changed since the last event on this connection (all
/// of them first; the page skips those it already shows).
async fn events<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut ticks = tokio::time::interval(console.refresh);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = (console, ticks, HashMap::<&'static str, String>::new());
    let stream = futures_util::stream::unfold(state, |(console, mut ticks, mut sent)| async move {
        loop {
            ticks.tick().await;
            let mut changed = serde_json::Map::new();
            for (id, html) in console.sections().await {
                let digest = hash(&html);
                if sent.get(id) != Some(&digest) {
                    changed.insert(
                        id.to_owned(),
                        serde_json::json!({ "hash": digest, "html": html }),
                    );
                    sent.insert(id, digest);
                }
            }
            if !changed.is_empty() {
                let event = Event::default()
                    .event("sections")
                    .data(serde_json::Value::Object(changed).to_string());
                return Some((Ok(event), (console, ticks, sent)));
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `303` back to the console with a notice saying what happened.
fn back(result: Result<String, AdminError>) -> Redirect {
    let (key, text) = match result {
        Ok(done) => ("notice", done),
        Err(err) => ("error", err.to_string()),
    };
    Redirect::to(&format!("/console?{key}={}", html::encode_query(&text)))
}

fn done(action: &ActionJson, what: &str) -> String {
    format!("{} {what} {}", capitalize(&action.action), action.id)
}

fn capitalize(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

async fn retry_saga<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .retry_saga(&id)
            .await
            .map(|s| format!("Retried saga {} (now {})", s.id, s.status.as_str())),
    )
}

async fn cancel_saga<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .cancel_saga(&id)
            .await
            .map(|s| format!("Cancelled saga {} (now {})", s.id, s.status.as_str())),
    )
}

async fn replay_letter<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .replay_dead_letter(&id)
            .await
            .map(|a| done(&a, "dead letter")),
    )
}

async fn discard_letter<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .discard_dead_letter(&id)
            .await
            .map(|a| done(&a, "dead letter")),
    )
}

async fn replay_parked<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .replay_parked(&id)
            .await
            .map(|a| done(&a, "parked outbox row")),
    )
}

async fn discard_parked<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .discard_parked(&id)
            .await
            .map(|a| done(&a, "parked outbox row")),
    )
}

async fn resend_delivery<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    Path(id): Path<String>,
) -> Redirect {
    back(
        console
            .admin
            .resend_delivery(&id)
            .await
            .map(|a| done(&a, "webhook delivery")),
    )
}

async fn login_page<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
) -> Response {
    if !console.admin.token().is_required() {
        return Redirect::to("/console").into_response();
    }
    Html(page::login(&console.title, None)).into_response()
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login_submit<S: MessagingStore + WebhookStore>(
    State(console): State<Console<S>>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    if !same_origin(&headers) {
        return forbidden();
    }
    let token = console.admin.token();
    let Some(cookie) = token.session_cookie() else {
        return Redirect::to("/console").into_response();
    };
    let refused = |status: StatusCode, why: &str| {
        (status, Html(page::login(&console.title, Some(why)))).into_response()
    };
    let Ok(Form(form)) = form else {
        return refused(
            StatusCode::BAD_REQUEST,
            "Send the token in the form's field.",
        );
    };
    if !token.verify(form.token.trim()) {
        tracing::warn!("console login with a wrong admin token");
        return refused(StatusCode::UNAUTHORIZED, "That is not the admin token.");
    }
    let mut response = Redirect::to("/console").into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

async fn logout(headers: HeaderMap) -> Response {
    if !same_origin(&headers) {
        return forbidden();
    }
    let mut response = Redirect::to("/console/login").into_response();
    let expired = format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    if let Ok(value) = HeaderValue::from_str(&expired) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

fn forbidden() -> Response {
    crate::problem::Problem::new(
        StatusCode::FORBIDDEN,
        "cross-origin request refused: use the console's own page",
    )
    .into_response()
}

#[cfg(test)]
mod tests;
