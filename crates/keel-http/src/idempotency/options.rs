//! What the Idempotency-Key layer does, with documented defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use axum::http::{HeaderName, Method, StatusCode, header};

use super::fingerprint::short_digest;

/// How long a key and its stored response live: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How long an in-flight key stays locked to the request processing it
/// without a renewal: 10 seconds. See [`IdempotencyOptions::lock`].
pub const DEFAULT_LOCK: Duration = Duration::from_secs(10);

/// The largest request body the layer buffers (it must read the body to
/// fingerprint it): 1 MiB. Larger bodies are refused with `413`.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// The largest response body stored for replay: 1 MiB. See
/// [`IdempotencyOptions::max_response_body`].
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;

/// The `Retry-After` of a `409` for a key in flight: 1 second.
pub const DEFAULT_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The principal of a request (whose keys are whose).
pub type PrincipalFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;

/// Which response statuses release the key instead of storing the response.
pub type ReleaseFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The default principal: a digest of the `Authorization` header, or
/// `anonymous` without one.
///
/// Only the digest is stored, never the credential. A credential that
/// changes between a request and its retry (a refreshed access token) makes
/// the retry a different principal, so services with real authentication
/// should set [`IdempotencyOptions::principal`] to read the authenticated
/// user id (e.g. from a request extension set by the auth layer).
pub fn default_principal(parts: &Parts) -> String {
    match parts.headers.get(header::AUTHORIZATION) {
        Some(value) => format!("authz:{}", short_digest(value.as_bytes())),
        None => "anonymous".to_owned(),
    }
}

/// The default release rule: `5xx` and `429 Too Many Requests`.
///
/// These say "the server could not do it now", so the client is invited to
/// retry, and the retry must run rather than replay the failure. The price:
/// a handler must not answer `5xx` after its side effect committed (roll
/// back, or answer `2xx`), or the retry runs it twice.
pub fn default_release(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// Options of the Idempotency-Key layer. Every limit has a documented
/// default; [`validate`](Self::validate) rejects values that cannot work.
#[derive(Clone)]
pub struct IdempotencyOptions {
    pub(crate) methods: Vec<Method>,
    pub(crate) required: bool,
    pub(crate) ttl: Duration,
    pub(crate) lock: Duration,
    pub(crate) max_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) in_flight_retry_after: Duration,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) principal: PrincipalFn,
    pub(crate) release: ReleaseFn,
}

impl fmt::Debug for IdempotencyOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyOptions")
            .field("methods", &self.methods)
            .field("required", &self.required)
            .field("ttl", &self.ttl)
            .field("lock", &self.lock)
            .field("max_body", &self.max_body)
            .field("max_response_body", &self.max_response_body)
            .field("in_flight_retry_after", &self.in_flight_retry_after)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .finish_non_exhaustive()
    }
}

impl Default for IdempotencyOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyOptions {
    /// The defaults: `POST` and `PATCH`, key required, TTL 24 h, lock 10 s,
    /// 1 MiB request and stored response bodies, `Retry-After: 1` on `409`,
    /// `content-type` in the fingerprint, [`default_principal`],
    /// [`default_release`].
    pub fn new() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            required: true,
            ttl: DEFAULT_TTL,
            lock: DEFAULT_LOCK,
            max_body: DEFAULT_MAX_BODY,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            in_flight_retry_after: DEFAULT_IN_FLIGHT_RETRY_AFTER,
            fingerprint_headers: vec![header::CONTENT_TYPE],
            principal: Arc::new(default_principal),
            release: Arc::new(default_release),
        }
    }

    /// The methods the layer applies to (default `POST`, `PATCH`); others
    /// pass through untouched. `GET`, `PUT` and `DELETE` are idempotent by
    /// definition and need no key.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Whether a request without a key is refused with `400` (default
    /// `true`). When `false` it passes through without protection.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// How long a key and its response are kept (default 24 h): retries
    /// within this window replay, later ones run as new requests. Pruning
    /// ([`prune_expired`](super::prune_expired)) deletes them afterwards.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long an in-flight key stays locked to the request processing it
    /// without a renewal (default 10 s). The layer renews the lock every
    /// third of it while the handler runs, so a slow request keeps its key;
    /// if the process dies the key is neither completed nor released, and
    /// within one lock a retry with the same request takes it over instead
    /// of getting `409` until the TTL ends. A request that cannot renew
    /// (the store does not answer) is stopped a fifth of the lock before it
    /// passes and answered `503`, so two runs of one key never overlap.
    pub fn lock(mut self, lock: Duration) -> Self {
        self.lock = lock;
        self
    }

    /// The largest request body buffered for the fingerprint (default
    /// 1 MiB); larger ones are refused with `413`.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger
    /// response still reaches the client, and the key is still completed
    /// (the operation happened and must not run twice), but it is stored
    /// with its status and headers only: the replay has an empty body and
    /// the header `idempotent-body-omitted: true`, telling the client to
    /// fetch the resource (e.g. from `Location`).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// The `Retry-After` sent with `409` while the key is in flight
    /// (default 1 s).
    pub fn in_flight_retry_after(mut self, after: Duration) -> Self {
        self.in_flight_retry_after = after;
        self
    }

    /// The request headers that are part of the fingerprint (default
    /// `content-type`). Add those that change what the handler does.
    pub fn fingerprint_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.fingerprint_headers = names.into_iter().collect();
        self
    }

    /// How to tell whose request it is: keys are scoped per principal, so
    /// two users choosing the same key never see each other's responses
    /// (default [`default_principal`]).
    pub fn principal(
        mut self,
        principal: impl Fn(&Parts) -> String + Send + Sync + 'static,
    ) -> Self {
        self.principal = Arc::new(principal);
        self
    }

    /// Which response statuses release the key (the retry runs again)
    /// instead of being stored and replayed (default [`default_release`]:
    /// `5xx` and `429`).
    pub fn release_when(
        mut self,
        release: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.release = Arc::new(release);
        self
    }

    /// Checks that the options can work.
    pub fn validate(&self) -> Result<(), InvalidIdempotencyOptions> {
        if self.methods.is_empty() {
            return Err(InvalidIdempotencyOptions::NoMethods);
        }
        if self.ttl.is_zero() {
            return Err(InvalidIdempotencyOptions::ZeroTtl);
        }
        if self.lock.is_zero() || self.lock > self.ttl {
            return Err(InvalidIdempotencyOptions::Lock {
                lock: self.lock,
                ttl: self.ttl,
            });
        }
        if self.max_body == 0 {
            return Err(InvalidIdempotencyOptions::ZeroMaxBody);
        }
        Ok(())
    }
}

/// Options of the Idempotency-Key layer that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidIdempotencyOptions {
    /// No method would be protected.
    #[error("the idempotency layer needs at least one method to protect")]
    NoMethods,
    /// A zero TTL would forget every key at once.
    #[error("the idempotency key TTL must be greater than zero")]
    ZeroTtl,
    /// The lock must be positive and no longer than the TTL.
    #[error(
        "the in-flight lock ({lock:?}) must be greater than zero and at most the TTL ({ttl:?})"
    )]
    Lock {
        /// The lock given.
        lock: Duration,
        /// The TTL given.
        ttl: Duration,
    },
    /// A zero body limit would refuse every request.
    #[error("the idempotency body limit must be at least one byte")]
    ZeroMaxBody,
}
