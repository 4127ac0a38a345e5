//! The `Idempotency-Key` layer: a retried `POST` gets the first response
//! again instead of charging the card twice.
//!
//! Networks lose responses, so clients retry, and a retried `POST` repeats
//! its side effect. With this layer the client sends a unique
//! `Idempotency-Key` per operation (the IETF draft "The Idempotency-Key HTTP
//! Header Field") and the server answers every retry of it with the first
//! response, byte for byte, marked `Idempotent-Replayed: true`.
//!
//! # The protocol
//!
//! For a request whose method is protected (default `POST` and `PATCH`):
//!
//! | situation | answer |
//! |---|---|
//! | no key, key required (the default) | `400` problem |
//! | malformed key, or longer than 255 characters | `400` problem |
//! | body over the limit (default 1 MiB) | `413` problem |
//! | new key | the handler runs; its response is stored, then sent |
//! | new key, the store did not confirm the stored response | `503` problem + `Retry-After`; the retry gets the response kept |
//! | same key, same request, finished | the stored response, `Idempotent-Replayed: true` |
//! | same key, same request, still running | `409` problem + `Retry-After` |
//! | same key, different request | `422` problem |
//! | key store unavailable | `503` problem + `Retry-After`; nothing ran |
//!
//! "Same request" is a SHA-256 fingerprint of the method, path, query, the
//! `content-type` header and the body (see
//! [`IdempotencyOptions::fingerprint_headers`]). Keys are scoped per
//! principal ([`IdempotencyOptions::principal`]), so two users picking the
//! same key never see each other's responses.
//!
//! # Why record the key *before* running the handler
//!
//! A check-then-run layer lets two concurrent duplicates both see "new"
//! and both run. Here [`IdempotencyStore::idempotency_begin`]
//! records the key as in flight atomically with the check, before the
//! handler runs: of any number of concurrent duplicates exactly one runs,
//! the others get `409` (or, once it finished, the replay).
//!
//! # When the key is released instead of stored
//!
//! A `5xx` or `429` response means "not now, retry": storing it would replay
//! the failure forever, so the key is released and the retry runs again
//! ([`IdempotencyOptions::release_when`]). Handlers must therefore not answer
//! `5xx` after their side effect committed. The key is also released when
//! the request's future is dropped (the client disconnected, the server
//! timed out) or the handler panics.
//!
//! # When the process dies
//!
//! An in-flight key belongs to one attempt (an owner token) and is locked
//! for a short time (10 s, [`IdempotencyOptions::lock`]) that the layer
//! renews every third of it while the handler runs. A process that dies
//! stops renewing, so within one lock a retry takes the key over and runs,
//! instead of getting `409` for minutes. The store lets only the key's
//! owner renew, complete or release it: an attempt that lost its key
//! changes nothing. An attempt that cannot renew (the store does not
//! answer) stops its handler a fifth of the lock before the lock passes
//! and answers `503`, so two runs of one key never overlap (work a handler
//! hands to a task of its own is beyond the layer's reach: make it safe to
//! repeat, as the reference shop does by deriving its event id from the
//! key).
//!
//! If the store fails while the response is stored or the key released (a
//! database restart), the layer keeps trying in the background, so retries
//! get the replay once the store is back. The request itself answers `503`
//! rather than the handler's response: a fresh answer goes out only once
//! the store confirmed it kept it, so one key never has two fresh answers.
//! That is the window a short lock trades for a fast takeover: a store
//! down for longer than the lock between a handler's effect and its stored
//! response may see a retry take the key over and run the handler again
//! when it returns. Handlers whose effect is in the same store close it as
//! the shop does: derive the effect's id from the key, and answer with
//! what a first run did.
//!
//! # Completing the key in the handler's transaction
//!
//! A handler whose effect lives in the layer's store can store its answer
//! in its own transaction with the [`HeldKey`] extractor: the key then
//! completes exactly when the effect commits, the layer writes nothing
//! after the handler, and the window above (effect committed, answer not
//! stored) does not exist. See [`HeldKey::complete_in`].
//!
//! Keys live 24 hours by default ([`IdempotencyOptions::ttl`]);
//! [`spawn_pruner`] or [`prune_expired`] delete them afterwards.
//!
//! Put the layer *inside* authentication (so the principal is known) and
//! outside everything that has side effects.
//!
//! ```
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use keel_http::idempotency::IdempotencyLayer;
//! use keel_sqlite::SqliteStore;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = SqliteStore::open_in_memory().await?;
//! let app = Router::new()
//!     .route("/orders", post(|| async { (StatusCode::CREATED, "order A-4471") }))
//!     .layer(IdempotencyLayer::new(store));
//!
//! let place = || {
//!     Request::post("/orders")
//!         .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
//!         .body(Body::from(r#"{"sku":"tea"}"#))
//! };
//! let first = app.clone().oneshot(place()?).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//!
//! // The response was lost; the client retries with the same key.
//! let retry = app.oneshot(place()?).await?;
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok(()) }
//! ```
//!
//! [`IdempotencyStore::idempotency_begin`]: keel_store::IdempotencyStore::idempotency_begin

mod fingerprint;
mod held;
mod key;
mod layer;
mod lease;
mod options;
mod prune;
mod service;
mod settle;

#[cfg(feature = "jobs")]
pub(crate) use key::parse_key;
/// The key parser and the request fingerprint, for the fuzz targets only
/// (`cargo fuzz` builds with `--cfg fuzzing`).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    use axum::http::request::Parts;
    use axum::http::{HeaderMap, HeaderName};

    /// See the layer's key parsing.
    pub fn parse_key(headers: &HeaderMap) -> Result<Option<String>, super::IdempotencyRejection> {
        super::key::parse_key(headers)
    }

    /// See the layer's fingerprint.
    pub fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> String {
        super::fingerprint::fingerprint(parts, headers, body)
    }
}

pub use held::{CompleteInError, Completion, HeldKey};
pub use key::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyRejection, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use options::{
    DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_LOCK, DEFAULT_MAX_BODY, DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_TTL, IdempotencyOptions, InvalidIdempotencyOptions, PrincipalFn, ReleaseFn,
    default_principal, default_release,
};
pub use prune::{DEFAULT_PRUNE_BATCH, DEFAULT_PRUNE_INTERVAL, prune_expired, spawn_pruner};
pub use service::{IDEMPOTENT_BODY_OMITTED, Idempotency, ResponseFuture};

#[cfg(test)]
mod tests;
