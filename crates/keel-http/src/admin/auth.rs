//! The admin token, and the layer that demands it.
//!
//! The admin API can replay messages and steer sagas, so it is as sensitive
//! as the database. [`AdminToken::require_for`] refuses to build an admin
//! bound to a non-loopback address without a token; on loopback a token is
//! optional (the machine's own users are trusted, as with a local database
//! socket).
//!
//! A client proves it knows the token with `Authorization: Bearer <token>`
//! (the CLI) or with the session cookie the console's login form sets. The
//! cookie holds an HMAC of the token, not the token, and is `HttpOnly` and
//! `SameSite=Strict`; state-changing requests that authenticate by cookie
//! must also come from the same origin (see [`same_origin`]), so another
//! site cannot make an operator's browser press a button.

use std::future::Ready;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use futures_util::future::Either;
use hmac::{Hmac, Mac};
use keel_core::{Classify, ErrorClass};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tower_layer::Layer;
use tower_service::Service;

use crate::problem::Problem;

/// The shortest token accepted, in characters.
pub const MIN_TOKEN_LEN: usize = 16;

/// The name of the console's session cookie.
pub const SESSION_COOKIE: &str = "keel_admin_session";

/// How long a console session cookie lives: 8 hours (a working day).
pub const SESSION_MAX_AGE_SECS: u64 = 8 * 3600;

/// The secret that guards the admin API and the console, or its deliberate
/// absence on a loopback address. Its `Debug` output never shows the token.
#[derive(Clone)]
pub struct AdminToken {
    secret: Option<Arc<str>>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("required", &self.is_required())
            .finish()
    }
}

/// An admin token could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdminTokenError {
    /// The admin would listen on a non-loopback address with no token.
    #[error(
        "refusing to expose the admin API and console on {addr} without a token: set an admin \
         token (e.g. --admin-token or KEEL_ADMIN_TOKEN), or listen on 127.0.0.1"
    )]
    MissingOnPublicAddress {
        /// The address it would listen on.
        addr: SocketAddr,
    },
    /// The token is shorter than [`MIN_TOKEN_LEN`].
    #[error("the admin token has {len} characters; use at least {min} random characters")]
    TooShort {
        /// Its length.
        len: usize,
        /// The minimum.
        min: usize,
    },
    /// The token has characters that cannot travel in an HTTP header.
    #[error("the admin token may only contain visible ASCII characters (no spaces)")]
    InvalidCharacters,
}

impl Classify for AdminTokenError {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

impl AdminToken {
    /// A required token. Refused when shorter than [`MIN_TOKEN_LEN`] or not
    /// visible ASCII.
    pub fn new(token: impl Into<String>) -> Result<Self, AdminTokenError> {
        let token = token.into();
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(AdminTokenError::InvalidCharacters);
        }
        let len = token.chars().count();
        if len < MIN_TOKEN_LEN {
            return Err(AdminTokenError::TooShort {
                len,
                min: MIN_TOKEN_LEN,
            });
        }
        Ok(Self {
            secret: Some(token.into()),
        })
    }

    /// The token for an admin listening on `addr`: `token` if given (and
    /// valid); no token only when `addr` is a loopback address, else
    /// [`AdminTokenError::MissingOnPublicAddress`].
    pub fn require_for(addr: SocketAddr, token: Option<String>) -> Result<Self, AdminTokenError> {
        match token {
            Some(token) => Self::new(token),
            None if addr.ip().is_loopback() => Ok(Self { secret: None }),
            None => Err(AdminTokenError::MissingOnPublicAddress { addr }),
        }
    }

    /// No token: every request is let in. Only for loopback listeners and
    /// tests; prefer [`require_for`](Self::require_for), which checks that.
    pub fn none() -> Self {
        Self { secret: None }
    }

    /// Whether requests must present the token.
    pub fn is_required(&self) -> bool {
        self.secret.is_some()
    }

    /// Whether `presented` is the token, compared in constant time (over
    /// SHA-256 digests, so the length does not leak either). Always true
    /// when no token is required.
    pub fn verify(&self, presented: &str) -> bool {
        match &self.secret {
            None => true,
            Some(secret) => digest(secret).ct_eq(&digest(presented)).into(),
        }
    }

    /// The value of the session cookie for this token: an HMAC of the
    /// token, so the cookie jar never holds the token itself. `None` when no
    /// token is required.
    pub fn session_value(&self) -> Option<String> {
        let secret = self.secret.as_ref()?;
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).ok()?;
        mac.update(b"keel-admin-session-v1");
        Some(hex::encode(mac.finalize().into_bytes()))
    }

    /// The `Set-Cookie` value that logs a browser in.
    pub fn session_cookie(&self) -> Option<String> {
        self.session_value().map(|value| {
            format!(
                "{SESSION_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_MAX_AGE_SECS}"
            )
        })
    }

    /// How `headers` authenticate, if they do.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Credential> {
        if !self.is_required() {
            return Some(Credential::NotRequired);
        }
        if let Some(bearer) = bearer(headers)
            && self.verify(bearer)
        {
            return Some(Credential::Bearer);
        }
        let expected = self.session_value()?;
        let presented = cookie(headers, SESSION_COOKIE)?;
        let same: bool = digest(&expected).ct_eq(&digest(presented)).into();
        same.then_some(Credential::SessionCookie)
    }
}

/// How a request proved it may use the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// No token is configured (loopback only).
    NotRequired,
    /// `Authorization: Bearer <token>`.
    Bearer,
    /// The console's session cookie.
    SessionCookie,
}

fn digest(value: &str) -> [u8; 32] {
    Sha256::digest(value.as_bytes()).into()
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// Whether a browser request comes from the page's own origin: its `Origin`
/// (or, without one, `Sec-Fetch-Site`) must name the `Host` it was sent to.
/// A request with neither (not a browser's) passes; it cannot carry the
/// `SameSite=Strict` cookie from another site anyway.
pub fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
        let origin = origin.to_str().ok();
        return match (origin, host) {
            (Some(origin), Some(host)) => origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                .is_some_and(|authority| authority.eq_ignore_ascii_case(host)),
            _ => false,
        };
    }
    match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        Some(site) => site == "same-origin" || site == "none",
        None => true,
    }
}

/// What an unauthenticated request gets.
#[derive(Debug, Clone)]
enum Refusal {
    /// `401` problem+json with `WWW-Authenticate: Bearer` (API clients).
    Problem,
    /// `303` to a login page (browsers).
    Redirect(Arc<str>),
}

/// A tower layer that lets only requests carrying the [`AdminToken`]
/// through (see the [admin module docs](crate::admin)); others get `401` problem+json,
/// or a redirect to a login page with
/// [`redirect_to`](Self::redirect_to). Unsafe methods authenticated by
/// cookie must also pass [`same_origin`], or get `403`.
#[derive(Debug, Clone)]
pub struct AdminAuthLayer {
    token: AdminToken,
    refusal: Refusal,
}

impl AdminAuthLayer {
    /// Demands `token`, answering `401` problem+json without it.
    pub fn new(token: AdminToken) -> Self {
        Self {
            token,
            refusal: Refusal::Problem,
        }
    }

    /// Answers unauthenticated requests with `303 See Other` to `login`.
    pub fn redirect_to(mut self, login: &str) -> Self {
        self.refusal = Refusal::Redirect(login.into());
        self
    }
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

impl<Svc, B> Service<Request<B>> for AdminAuth<Svc>
where
    Svc: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = Svc::Error;
    type Future = Either<Svc::Future, Ready<Result<Response, Svc::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        match self.layer.refusal(request.method(), request.headers()) {
            None => Either::Left(self.inner.call(request)),
            Some(refused) => Either::Right(std::future::ready(Ok(refused))),
        }
    }
}

impl AdminAuthLayer {
    /// The answer to a request that may not pass, or `None` to let it in.
    fn refusal(&self, method: &Method, headers: &HeaderMap) -> Option<Response> {
        match self.token.authenticate(headers) {
            None => Some(self.refuse()),
            Some(Credential::SessionCookie | Credential::NotRequired)
                if !method.is_safe() && !same_origin(headers) =>
            {
                Some(Problem::new(
                    StatusCode::FORBIDDEN,
                    "cross-origin request refused: admin actions must come from the console's own page",
                )
                .into_response())
            }
            Some(_) => None,
        }
    }

    fn refuse(&self) -> Response {
        match &self.refusal {
            Refusal::Redirect(login) => Redirect::to(login).into_response(),
            Refusal::Problem => {
                let mut response = Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "the admin API needs the admin token: send `Authorization: Bearer <token>`",
                )
                .with_type("urn:keel:problem:admin_unauthorized")
                .into_response();
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"keel-admin\""),
                );
                response
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "correct-horse-battery-staple";

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn a_public_address_needs_a_token_and_loopback_does_not() {
        let public: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert_eq!(
            AdminToken::require_for(public, None).unwrap_err(),
            AdminTokenError::MissingOnPublicAddress { addr: public }
        );
        assert!(
            !AdminToken::require_for(loopback, None)
                .unwrap()
                .is_required()
        );
        assert!(
            AdminToken::require_for(public, Some(TOKEN.into()))
                .unwrap()
                .is_required()
        );
        assert!(matches!(
            AdminToken::new("short"),
            Err(AdminTokenError::TooShort { len: 5, .. })
        ));
        assert_eq!(
            AdminToken::new("has a space in it, sadly").unwrap_err(),
            AdminTokenError::InvalidCharacters
        );
    }

    #[test]
    fn bearer_and_cookie_authenticate_and_nothing_else_does() {
        let token = AdminToken::new(TOKEN).unwrap();
        assert!(!format!("{token:?}").contains(TOKEN));
        let auth = format!("Bearer {TOKEN}");
        assert_eq!(
            token.authenticate(&headers(&[("authorization", &auth)])),
            Some(Credential::Bearer)
        );
        assert_eq!(
            token.authenticate(&headers(&[(
                "authorization",
                "Bearer wrong-token-wrong-token"
            )])),
            None
        );
        let session = token.session_value().unwrap();
        assert_ne!(session, TOKEN, "the cookie does not hold the token");
        let cookie = format!("other=1; {SESSION_COOKIE}={session}");
        assert_eq!(
            token.authenticate(&headers(&[("cookie", &cookie)])),
            Some(Credential::SessionCookie)
        );
        assert_eq!(
            token.authenticate(&headers(&[("cookie", "keel_admin_session=forged")])),
            None
        );
        assert_eq!(token.authenticate(&HeaderMap::new()), None);
        let set = token.session_cookie().unwrap();
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"));
    }

    #[test]
    fn cross_origin_posts_are_told_apart_from_same_origin_ones() {
        let host = ("host", "127.0.0.1:8080");
        assert!(same_origin(&headers(&[
            host,
            ("origin", "http://127.0.0.1:8080")
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "http://evil.example")
        ])));
        assert!(!same_origin(&headers(&[host, ("origin", "null")])));
        assert!(!same_origin(&headers(&[
            host,
            ("sec-fetch-site", "cross-site")
        ])));
        assert!(same_origin(&headers(&[host])), "curl sends neither");
    }
}
