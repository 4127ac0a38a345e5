//! The operator console: server-rendered HTML at `/console`, kept live over
//! SSE, with a button for every lever the admin API offers.
//!
//! An incident is the worst time to install a dashboard, so the console is
//! part of the server: no front-end build, no external assets, no framework
//! — plain HTML forms that work without JavaScript, and twenty lines of
//! script that open an `EventSource` on `/console/events` and swap in each
//! section (sagas, dead letters, parked outbox rows, webhook deliveries,
//! breakers, lag) when
//! its content changes (checked every second by default). The browser
//! reconnects a dropped stream by itself, but gives up for good when the
//! server answers with an error (a `503` while it restarts, say); the
//! script then opens a new stream after a jittered, doubling wait (up to
//! 30 s), so a console left open comes back live on its own.
//!
//! Every button is a form POSTing to a console route that calls the same
//! [`Admin`] operation as the JSON API (and the `keel` CLI), then answers
//! `303` back to the page, whose next view shows what happened (a notice
//! kept server-side for the session: no text ever comes from the URL).
//! The console sits behind the same [`AdminAccess`](crate::AdminAccess):
//! `/console/login` takes the token once (or, on a loopback server without
//! one, just opens a session) and sets an `HttpOnly`, `SameSite=Strict`
//! session cookie that expires; every form carries the session's CSRF
//! token, every POST must come from an allowed origin, and logging out
//! revokes the session. Pages are sent with a strict
//! `Content-Security-Policy` (only the console's own inline script and
//! style, by hash), `X-Frame-Options: DENY`, `nosniff` and `no-store`.
//!
//! Elements carry stable attributes for tests and scripts:
//! `data-saga-id`, `data-dead-letter-id`, `data-parked-id`, `data-delivery-id`,
//! `data-status`, `data-action="retry|cancel|replay|discard|resend"`.
//!
//! ```no_run
//! # async fn demo(store: keel_sqlite::store::SqliteStore) {
//! use keel_admin::Admin;
//! use keel_admin::console::Console;
//!
//! let admin = Admin::builder(store).build();
//! let app = admin.router().merge(Console::new(admin).router());
//! # let _ = app; }
//! ```

mod graph;
mod html;
mod page;
mod render;
mod trends;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::AdminStore;
use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{Extension, Form, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{MethodRouter, get, post};
use futures_util::Stream;
use keel_store::SagaStatus;

use crate::history::SubjectKind;
use serde::Deserialize;
use sha2::{Digest, Sha256};

#[cfg(feature = "webhooks")]
use crate::DeliveryQuery;
use crate::routes::ConnectedIp;

pub use html::escape;

use crate::{
    ActionJson, Admin, AdminError, AdminSession, CSRF_FIELD, DeadLetterQuery, Notice, ParkedQuery,
    SagaQuery,
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
    S: AdminStore,
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
        self.rows = rows.clamp(1, crate::MAX_LIMIT);
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
        let access = self.admin.access();
        let csp = page::content_security_policy();
        let protected = Router::new()
            .route("/console", get(console_page::<S>))
            .route("/console/", get(|| async { Redirect::to("/console") }))
            .route("/console/events", get(events::<S>))
            .route("/console/history/{kind}/{name}", get(detail_page::<S>))
            .route(
                "/console/sagas/{id}/retry",
                button(|admin, id| {
                    Box::pin(async move {
                        let saga = admin.retry_saga(&id).await?;
                        Ok(format!(
                            "Retried saga {} (now {})",
                            saga.id,
                            saga.status.as_str()
                        ))
                    })
                }),
            )
            .route(
                "/console/sagas/{id}/cancel",
                button(|admin, id| {
                    Box::pin(async move {
                        let saga = admin.cancel_saga(&id).await?;
                        Ok(format!(
                            "Cancelled saga {} (now {})",
                            saga.id,
                            saga.status.as_str()
                        ))
                    })
                }),
            )
            .route(
                "/console/dead-letters/{id}/replay",
                button(|admin, id| {
                    Box::pin(async move {
                        Ok(done(&admin.replay_dead_letter(&id).await?, "dead letter"))
                    })
                }),
            )
            .route(
                "/console/dead-letters/{id}/discard",
                button(|admin, id| {
                    Box::pin(async move {
                        Ok(done(&admin.discard_dead_letter(&id).await?, "dead letter"))
                    })
                }),
            )
            .route(
                "/console/outbox/parked/{id}/replay",
                button(|admin, id| {
                    Box::pin(async move {
                        Ok(done(&admin.replay_parked(&id).await?, "parked outbox row"))
                    })
                }),
            )
            .route(
                "/console/outbox/parked/{id}/discard",
                button(|admin, id| {
                    Box::pin(async move {
                        Ok(done(&admin.discard_parked(&id).await?, "parked outbox row"))
                    })
                }),
            )
            .route("/console/logout", post(logout::<S>));
        #[cfg(feature = "webhooks")]
        let protected = protected.route(
            "/console/webhook-deliveries/{id}/resend",
            button(|admin, id| {
                Box::pin(
                    async move { Ok(done(&admin.resend_delivery(&id).await?, "webhook delivery")) },
                )
            }),
        );
        let protected = protected
            .route_layer(access.page_layer("/console/login", csp))
            .with_state(self.clone());
        let open = Router::new()
            .route(
                "/console/login",
                get(login_page::<S>).post(login_submit::<S>),
            )
            .route_layer(access.login_layer(csp))
            .with_state(self.clone());
        protected.merge(open)
    }

    /// Every section's HTML, in page order.
    async fn sections(&self) -> Vec<(&'static str, String)> {
        let admin = &self.admin;
        let rows = self.rows.to_string();
        let history = admin.history();
        let summary = render::or_error(admin.summary().await, |s| render::summary(&s, history));
        let consumers = trends::consumers(history);
        let dependencies = trends::dependencies(history);
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
        #[cfg(feature = "webhooks")]
        let deliveries = self.deliveries(rows).await;
        let breakers = render::breakers(&admin.breakers(), history);
        let lag = render::or_error(admin.lag().await, |l| render::lag(&l, history));
        let html = [
            summary,
            consumers,
            dependencies,
            sagas,
            letters,
            parked,
            #[cfg(feature = "webhooks")]
            deliveries,
            breakers,
            lag,
        ];
        render::SECTIONS.iter().copied().zip(html).collect()
    }

    /// The sections of `view`.
    async fn view(&self, view: &View) -> Vec<(&'static str, String)> {
        match view {
            View::Console => self.sections().await,
            View::Detail(kind, name) => {
                vec![("detail", trends::detail(self.admin.history(), *kind, name))]
            }
        }
    }

    /// The newest webhook deliveries with their attempt logs.
    #[cfg(feature = "webhooks")]
    async fn deliveries(&self, rows: String) -> String {
        let query = DeliveryQuery {
            limit: Some(rows),
            ..DeliveryQuery::default()
        };
        render::or_error(self.admin.deliveries(&query, true).await, |d| {
            render::deliveries(&d)
        })
    }

    /// Stuck sagas first, then compensating, then running.
    async fn active_sagas(&self, rows: &str) -> Result<Vec<crate::SagaJson>, AdminError> {
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

/// Every form of `html` with the session's CSRF token in it (the
/// console builds all its forms with one helper, so each ends the same way).
fn with_csrf(html: &str, session: Option<&AdminSession>) -> String {
    match session {
        Some(session) => html.replace(
            "</form>",
            &format!(
                "<input type=\"hidden\" name=\"{CSRF_FIELD}\" value=\"{}\"></form>",
                session.csrf
            ),
        ),
        None => html.to_owned(),
    }
}

async fn console_page<S: AdminStore>(
    State(console): State<Console<S>>,
    session: Option<Extension<AdminSession>>,
) -> Html<String> {
    let session = session.map(|Extension(s)| s);
    let notice = session
        .as_ref()
        .and_then(|s| console.admin.access().sessions().take_notice(s));
    let notice = notice.as_ref().map(|n| (n.text.as_str(), n.is_error));
    let sections = console.sections().await;
    render_page(
        &console,
        session.as_ref(),
        notice,
        &sections,
        "/console/events",
    )
}

/// A page of `sections`, kept live by the stream at `events`.
fn render_page<S>(
    console: &Console<S>,
    session: Option<&AdminSession>,
    notice: Option<(&str, bool)>,
    sections: &[(&'static str, String)],
    events: &str,
) -> Html<String> {
    let hashes: Vec<String> = sections.iter().map(|(_, h)| hash(h)).collect();
    let sections: Vec<page::Section<'_>> = sections
        .iter()
        .zip(&hashes)
        .map(|((id, html), hash)| page::Section { id, hash, html })
        .collect();
    let page = page::Page {
        title: &console.title,
        notice,
        sections: &sections,
        logout: session.is_some(),
        events,
    };
    Html(with_csrf(&page::console(&page), session))
}

/// `/console/history/{kind}/{name}`: one subject's graphs, large.
async fn detail_page<S: AdminStore>(
    State(console): State<Console<S>>,
    session: Option<Extension<AdminSession>>,
    Path((kind, name)): Path<(String, String)>,
) -> Response {
    let Some(view) = View::detail(&kind, name) else {
        return (StatusCode::NOT_FOUND, "no such kind of history").into_response();
    };
    let session = session.map(|Extension(s)| s);
    let sections = console.view(&view).await;
    let events = format!(
        "/console/events?view={}",
        html::encode_segment(&view.query())
    );
    render_page(&console, session.as_ref(), None, &sections, &events).into_response()
}

/// What a page shows: the console's sections, or one subject's history.
#[derive(Debug, Clone, PartialEq, Eq)]
enum View {
    Console,
    Detail(SubjectKind, String),
}

impl View {
    fn detail(kind: &str, name: String) -> Option<Self> {
        Some(Self::Detail(SubjectKind::parse(kind)?, name))
    }

    /// `kind/name`, the stream's `view` parameter.
    fn query(&self) -> String {
        match self {
            Self::Console => String::new(),
            Self::Detail(kind, name) => format!("{}/{name}", kind.as_str()),
        }
    }

    fn parse(query: Option<&str>) -> Self {
        query
            .and_then(|q| q.split_once('/'))
            .and_then(|(kind, name)| Self::detail(kind, name.to_owned()))
            .unwrap_or(Self::Console)
    }
}

#[derive(Debug, Default, Deserialize)]
struct EventsQuery {
    view: Option<String>,
}

/// The live stream: a `sections` event with `{id: {hash, html}}` for every
/// section whose HTML changed since the last event on this connection (all
/// of them first; the page skips those it already shows).
async fn events<S: AdminStore>(
    State(console): State<Console<S>>,
    session: Option<Extension<AdminSession>>,
    Query(query): Query<EventsQuery>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let session = session.map(|Extension(s)| s);
    let view = View::parse(query.view.as_deref());
    let mut ticks = tokio::time::interval(console.refresh);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = (console, ticks, HashMap::<&'static str, String>::new());
    let stream = futures_util::stream::unfold(state, move |(console, mut ticks, mut sent)| {
        let (session, view) = (session.clone(), view.clone());
        async move {
            loop {
                ticks.tick().await;
                let mut changed = serde_json::Map::new();
                for (id, html) in console.view(&view).await {
                    // Hashed before the token goes in, as the page's are, so
                    // the page skips what it already shows.
                    let digest = hash(&html);
                    if sent.get(id) != Some(&digest) {
                        let html = with_csrf(&html, session.as_ref());
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
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `303` back to the console, whose next view says what happened.
fn back<S: AdminStore>(
    console: &Console<S>,
    session: Option<Extension<AdminSession>>,
    result: Result<String, AdminError>,
) -> Redirect {
    let notice = match result {
        Ok(text) => Notice {
            text,
            is_error: false,
        },
        Err(err) => Notice {
            text: err.to_string(),
            is_error: true,
        },
    };
    if let Some(Extension(session)) = session {
        console
            .admin
            .access()
            .sessions()
            .set_notice(&session, notice);
    }
    Redirect::to("/console")
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

/// A console button: runs `op` on the id in the path, then answers `303`
/// back to the console with the outcome as the session's notice. Every
/// button is one of these, so each ends the same way.
fn button<S>(op: fn(Admin<S>, String) -> Outcome) -> MethodRouter<Console<S>>
where
    S: AdminStore,
{
    post(
        move |State(console): State<Console<S>>,
              session: Option<Extension<AdminSession>>,
              Path(id): Path<String>| async move {
            let result = op(console.admin.clone(), id).await;
            back(&console, session, result)
        },
    )
}

/// What a button's operation answers: the notice's text, or the error.
type Outcome = Pin<Box<dyn Future<Output = Result<String, AdminError>> + Send>>;

async fn login_page<S: AdminStore>(
    State(console): State<Console<S>>,
    headers: HeaderMap,
) -> Response {
    if !console.admin.token().is_required() {
        // Loopback without a token: a session is only the CSRF token's home.
        return start_session(&console, &headers);
    }
    Html(page::login(&console.title, None)).into_response()
}

fn start_session<S: AdminStore>(console: &Console<S>, headers: &HeaderMap) -> Response {
    let mut response = Redirect::to("/console").into_response();
    console
        .admin
        .access()
        .start_session(headers, response.headers_mut());
    response
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login_submit<S: AdminStore>(
    State(console): State<Console<S>>,
    ConnectedIp(ip): ConnectedIp,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let token = console.admin.token();
    if !token.is_required() {
        return start_session(&console, &headers);
    }
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
        tracing::warn!(client = ?ip, "console login with a wrong admin token");
        console.admin.access().throttle().fail(ip);
        return refused(StatusCode::UNAUTHORIZED, "That is not the admin token.");
    }
    start_session(&console, &headers)
}

async fn logout<S: AdminStore>(
    State(console): State<Console<S>>,
    session: Option<Extension<AdminSession>>,
    headers: HeaderMap,
) -> Response {
    let mut response = Redirect::to("/console/login").into_response();
    let session = session.map(|Extension(s)| s);
    console
        .admin
        .access()
        .end_session(session.as_ref(), &headers, response.headers_mut());
    response
}

#[cfg(test)]
mod tests;
