//! [`AdminAccess`]: who may use the admin API and the console, and the
//! layer that enforces it.
//!
//! Every request, whatever its credential, must name an allowed `Host`
//! ([`AllowedHosts`]): a browser led to the server by DNS rebinding sends
//! the attacker's name and is refused before anything else. A client that
//! failed too often waits ([`FailureThrottle`]).
//!
//! A request then proves who it is and, for anything that changes state,
//! that it was meant:
//!
//! | credential | safe methods | unsafe methods |
//! |---|---|---|
//! | `Authorization: Bearer <admin token>` | yes | yes |
//! | session cookie ([`Sessions`]) | yes | with its CSRF token (`X-Keel-CSRF` header or `csrf` form field) and no foreign `Origin` |
//! | none, no token configured (loopback) | API only | never |
//! | none, token configured | `401` (API) or `303` to the login page (console) | same |
//!
//! So without a token an unsafe request still needs a session, and a
//! session is only useful with the CSRF token that only a same-origin
//! page (or a client that asked `POST /admin/api/session`) can read.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use futures_util::future::BoxFuture;
use tower_layer::Layer;
use tower_service::Service;

use super::auth::{AdminToken, cookie};
use super::session::{AdminSession, DEFAULT_SESSION_TTL, Sessions};
use keel_http::access::{AllowedHosts, FailureThrottle, client_ip};
use keel_http::problem::Problem;

/// The name of the session cookie.
pub const SESSION_COOKIE: &str = "keel_admin_session";

/// The header that carries a session's CSRF token.
pub const CSRF_HEADER: &str = "x-keel-csrf";

/// The form field that carries a session's CSRF token.
pub const CSRF_FIELD: &str = "csrf";

/// The largest form body read to find the CSRF field: 16 KiB.
const MAX_FORM_BODY: usize = 16 * 1024;

/// Who may use the admin API and the console; see the module docs. Cheap
/// to clone.
#[derive(Debug, Clone)]
pub struct AdminAccess {
    inner: Arc<AccessInner>,
}

#[derive(Debug)]
struct AccessInner {
    token: AdminToken,
    sessions: Sessions,
    hosts: AllowedHosts,
    throttle: FailureThrottle,
    /// The server terminates TLS itself: every request came over HTTPS.
    over_tls: bool,
}

impl AdminAccess {
    /// Access guarded by `token`, answering only loopback `Host` names,
    /// with sessions of [`DEFAULT_SESSION_TTL`] and the default throttle.
    pub fn new(token: AdminToken) -> Self {
        Self::with(
            token,
            AllowedHosts::loopback(),
            DEFAULT_SESSION_TTL,
            FailureThrottle::default(),
        )
    }

    /// Access with every setting given.
    pub fn with(
        token: AdminToken,
        hosts: AllowedHosts,
        session_ttl: Duration,
        throttle: FailureThrottle,
    ) -> Self {
        let sessions = Sessions::new(token.secret(), session_ttl);
        Self {
            inner: Arc::new(AccessInner {
                token,
                sessions,
                hosts,
                throttle,
                over_tls: false,
            }),
        }
    }

    /// This access as served by a server that terminates TLS itself: every
    /// session cookie is `Secure`, whatever the forwarded headers say.
    pub fn served_over_tls(self, over_tls: bool) -> Self {
        let inner = &self.inner;
        Self {
            inner: Arc::new(AccessInner {
                token: inner.token.clone(),
                sessions: inner.sessions.clone(),
                hosts: inner.hosts.clone(),
                throttle: inner.throttle.clone(),
                over_tls,
            }),
        }
    }

    /// The admin token.
    pub fn token(&self) -> &AdminToken {
        &self.inner.token
    }

    /// The sessions.
    pub fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }

    /// The `Host` names answered.
    pub fn hosts(&self) -> &AllowedHosts {
        &self.inner.hosts
    }

    /// The failed-credential throttle.
    pub fn throttle(&self) -> &FailureThrottle {
        &self.inner.throttle
    }

    /// The session the request's cookie carries, if valid.
    pub fn session_of(&self, headers: &HeaderMap) -> Option<AdminSession> {
        cookie(headers, SESSION_COOKIE).and_then(|v| self.inner.sessions.verify(v))
    }

    /// Starts a session for the client of `request`: the response headers
    /// `answer` set its cookie (`HttpOnly`, `SameSite=Strict`, and `Secure` when the request
    /// came over HTTPS: the server's own TLS ([`served_over_tls`](Self::served_over_tls)),
    /// or as a proxy's `X-Forwarded-Proto` or `Forwarded` says).
    pub fn start_session(&self, request: &HeaderMap, answer: &mut HeaderMap) -> AdminSession {
        let (session, value) = self.inner.sessions.issue();
        let max_age = self.inner.sessions.ttl().as_secs();
        let secure = self.inner.over_tls || over_https(request);
        set_cookie(answer, secure, &value, max_age);
        session
    }

    /// Ends `session` (if the request had one); the response headers
    /// `answer` remove the cookie.
    pub fn end_session(
        &self,
        session: Option<&AdminSession>,
        request: &HeaderMap,
        answer: &mut HeaderMap,
    ) {
        if let Some(session) = session {
            self.inner.sessions.revoke(session);
        }
        let secure = self.inner.over_tls || over_https(request);
        set_cookie(answer, secure, "", 0);
    }

    /// The layer of the JSON API: `401` problems.
    pub fn api_layer(&self) -> AdminAuthLayer {
        self.layer(Mode::Api)
    }

    /// The layer of HTML pages: `303` to `login` without a session, and
    /// `csp` as their `Content-Security-Policy`.
    pub fn page_layer(&self, login: &str, csp: &str) -> AdminAuthLayer {
        self.layer(Mode::Page {
            login: login.into(),
            csp: csp.into(),
        })
    }

    /// The layer of the routes that start a session: the `Host`, throttle
    /// and `Origin` checks, no credential required.
    pub fn login_layer(&self, csp: &str) -> AdminAuthLayer {
        self.layer(Mode::Login { csp: csp.into() })
    }

    fn layer(&self, mode: Mode) -> AdminAuthLayer {
        AdminAuthLayer {
            access: self.clone(),
            mode: Arc::new(mode),
        }
    }

    /// Whether an unsafe request's `Origin` (or `Sec-Fetch-Site`) allows
    /// it: a browser names the page it comes from, which must be one of
    /// ours; a client that names none is not a browser, and still needs a
    /// credential.
    fn intended_origin(&self, headers: &HeaderMap) -> bool {
        if let Some(origin) = headers.get(header::ORIGIN) {
            return origin
                .to_str()
                .is_ok_and(|o| self.inner.hosts.allows_origin(o));
        }
        match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
            Some(site) => site == "same-origin" || site == "none",
            None => true,
        }
    }

    async fn admit(&self, mode: &Mode, request: Request<Body>) -> Result<Request<Body>, Refused> {
        let headers = request.headers();
        if !self.inner.hosts.allows_request(headers) {
            tracing::warn!(host = ?headers.get(header::HOST), "admin request for an unknown Host refused");
            return Err(refusal(
                StatusCode::FORBIDDEN,
                "host_not_allowed",
                "this server does not answer to that Host name; an operator can add it to the \
                 allowed hosts (--allowed-hosts)",
            ));
        }
        let ip = client_ip(request.extensions());
        if let Err(throttled) = self.inner.throttle.check(ip) {
            return Err(Box::new(
                Problem::new(StatusCode::TOO_MANY_REQUESTS, throttled.to_string())
                    .with_retry_after(throttled.retry_after)
                    .into_response(),
            ));
        }
        let unsafe_method = !request.method().is_safe();
        if unsafe_method && !self.intended_origin(headers) {
            return Err(refusal(
                StatusCode::FORBIDDEN,
                "cross_origin",
                "cross-origin request refused: admin actions must come from the console's own page",
            ));
        }
        let token = &self.inner.token;
        if !token.is_required() && keel_http::access::is_forwarded(headers) {
            // Without a token only this machine's users may act; behind a
            // proxy on this machine every client would look like one.
            tracing::warn!(client = ?ip, "proxied admin request to a server without an admin token refused");
            return Err(refusal(
                StatusCode::FORBIDDEN,
                "proxied_without_token",
                "this request came through a proxy, and this server has no admin token: without \
                 one it answers only clients on its own machine; start it with an admin token \
                 (--admin-token)",
            ));
        }
        if matches!(mode, Mode::Login { .. }) {
            return Ok(request);
        }
        if token.is_required()
            && let Some(presented) = keel_http::access::bearer(headers)
        {
            if token.verify(presented) {
                return Ok(request);
            }
            tracing::warn!(client = ?ip, "admin request with a wrong bearer token refused");
            self.inner.throttle.fail(ip);
            return Err(mode.refuse());
        }
        let Some(session) = self.session_of(headers) else {
            return match mode {
                Mode::Api if !token.is_required() && !unsafe_method => Ok(request),
                Mode::Api if !token.is_required() => Err(refusal(
                    StatusCode::FORBIDDEN,
                    "admin_intent_required",
                    "state-changing admin requests need a session and its CSRF token: POST \
                     /admin/api/session, then send its cookie and X-Keel-CSRF (or configure an \
                     admin token and send it as a bearer token)",
                )),
                _ => Err(mode.refuse()),
            };
        };
        let mut request = if unsafe_method {
            checked_csrf(&session, request).await?
        } else {
            request
        };
        request.extensions_mut().insert(session);
        Ok(request)
    }
}

/// Sets the session cookie to `value` for `max_age` seconds.
fn set_cookie(answer: &mut HeaderMap, secure: bool, value: &str, max_age: u64) {
    let secure = if secure { "; Secure" } else { "" };
    let cookie = format!(
        "{SESSION_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
    );
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        answer.insert(header::SET_COOKIE, cookie);
    }
}

/// Whether the request reached the first proxy over HTTPS.
fn over_https(headers: &HeaderMap) -> bool {
    let forwarded_proto = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .next()
                .is_some_and(|p| p.trim().eq_ignore_ascii_case("https"))
        });
    let forwarded = headers
        .get(header::FORWARDED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split([';', ','])
                .any(|pair| pair.trim().eq_ignore_ascii_case("proto=https"))
        });
    forwarded_proto || forwarded
}

/// The request again, if it carries `session`'s CSRF token in the header
/// or in its form body.
async fn checked_csrf(
    session: &AdminSession,
    request: Request<Body>,
) -> Result<Request<Body>, Refused> {
    let missing = || {
        refusal(
            StatusCode::FORBIDDEN,
            "csrf",
            "this action needs the session's CSRF token: reload the console page and try again",
        )
    };
    if let Some(value) = request.headers().get(CSRF_HEADER) {
        let matches = value
            .to_str()
            .is_ok_and(|v| Sessions::csrf_matches(session, v));
        return if matches { Ok(request) } else { Err(missing()) };
    }
    let is_form = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !is_form {
        return Err(missing());
    }
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_FORM_BODY)
        .await
        .map_err(|_| missing())?;
    let found = std::str::from_utf8(&bytes).ok().and_then(|form| {
        form.split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(key, _)| *key == CSRF_FIELD)
            .map(|(_, value)| value)
    });
    match found {
        Some(value) if Sessions::csrf_matches(session, value) => {
            Ok(Request::from_parts(parts, Body::from(bytes)))
        }
        _ => Err(missing()),
    }
}

/// A refused request's answer (boxed: a response is large, and most
/// requests pass).
type Refused = Box<Response>;

fn refusal(status: StatusCode, kind: &str, detail: &str) -> Refused {
    Box::new(Problem::new(status, detail).typed(kind).into_response())
}

/// What a layer guards.
#[derive(Debug)]
enum Mode {
    /// The JSON API: refusals are `401` problems.
    Api,
    /// HTML pages: refusals are `303` to the login page.
    Page { login: Arc<str>, csp: Arc<str> },
    /// The routes that start a session.
    Login { csp: Arc<str> },
}

impl Mode {
    fn refuse(&self) -> Refused {
        match self {
            Mode::Page { login, .. } => Box::new(Redirect::to(login).into_response()),
            Mode::Api | Mode::Login { .. } => {
                let mut response = refusal(
                    StatusCode::UNAUTHORIZED,
                    "admin_unauthorized",
                    "the admin API needs the admin token: send `Authorization: Bearer <token>`",
                );
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"keel-admin\""),
                );
                response
            }
        }
    }

    fn csp(&self) -> &str {
        match self {
            Mode::Api => "default-src 'none'; frame-ancestors 'none'",
            Mode::Page { csp, .. } | Mode::Login { csp } => csp,
        }
    }
}

/// Headers on every admin and console response: nothing is cached,
/// sniffed, framed or sent to another site as a referrer. (`same-origin`,
/// not `no-referrer`: under `no-referrer` browsers send `Origin: null` on
/// the console's own form posts, which the origin check must refuse.)
fn harden(mode: &Mode, response: &mut Response) {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    if let Ok(csp) = HeaderValue::from_str(mode.csp()) {
        headers.insert(HeaderName::from_static("content-security-policy"), csp);
    }
}

/// A tower layer that admits requests as [`AdminAccess`] says (see the
/// module docs) and hardens every response's headers.
#[derive(Debug, Clone)]
pub struct AdminAuthLayer {
    access: AdminAccess,
    mode: Arc<Mode>,
}

impl<Svc> Layer<Svc> for AdminAuthLayer {
    type Service = AdminAuth<Svc>;

    fn layer(&self, inner: Svc) -> Self::Service {
        AdminAuth {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`AdminAuthLayer`].
#[derive(Debug, Clone)]
pub struct AdminAuth<Svc> {
    inner: Svc,
    layer: AdminAuthLayer,
}

impl<Svc> Service<Request<Body>> for AdminAuth<Svc>
where
    Svc: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    Svc::Future: Send,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was made ready serves this request.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let layer = self.layer.clone();
        Box::pin(async move {
            let mut response = match layer.access.admit(&layer.mode, request).await {
                Ok(request) => inner.call(request).await?,
                Err(refused) => *refused,
            };
            harden(&layer.mode, &mut response);
            Ok(response)
        })
    }
}
