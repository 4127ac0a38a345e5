//! Reading the `Idempotency-Key` header, and the refusals of the layer.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::problem::Problem;

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replayed response (`true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The longest key accepted, in characters (the draft's keys are UUIDs; a
/// bound keeps the store's primary key small).
pub const MAX_KEY_LEN: usize = 255;

/// Parses the key out of `headers`: `Ok(None)` if there is none.
///
/// The IETF draft makes the value a Structured Field string (`"..."`); a bare
/// token is accepted too, since most clients send one. Either way the key
/// must be 1 to [`MAX_KEY_LEN`] visible ASCII characters (`!` to `~`).
pub(crate) fn parse_key(headers: &HeaderMap) -> Result<Option<String>, IdempotencyRejection> {
    let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(IdempotencyRejection::MultipleKeys);
    }
    let raw = value.as_bytes().trim_ascii();
    let unquoted = match raw {
        [b'"', inner @ .., b'"'] => unescape(inner)?,
        [b'"', ..] => {
            return Err(IdempotencyRejection::InvalidKey(
                "unterminated quoted string",
            ));
        }
        bare => bare.to_vec(),
    };
    if unquoted.is_empty() {
        return Err(IdempotencyRejection::InvalidKey("the key is empty"));
    }
    if unquoted.len() > MAX_KEY_LEN {
        return Err(IdempotencyRejection::KeyTooLong {
            len: unquoted.len(),
        });
    }
    if !unquoted.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(IdempotencyRejection::InvalidKey(
            "the key must be visible ASCII characters only (no spaces, controls or non-ASCII)",
        ));
    }
    // Every byte is ASCII, so this cannot fail.
    String::from_utf8(unquoted)
        .map(Some)
        .map_err(|_| IdempotencyRejection::InvalidKey("the key is not ASCII"))
}

/// Removes an sf-string's `\"` and `\\` escapes.
fn unescape(inner: &[u8]) -> Result<Vec<u8>, IdempotencyRejection> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&esc @ (b'"' | b'\\')) => out.push(esc),
                _ => {
                    return Err(IdempotencyRejection::InvalidKey(
                        "bad escape in quoted string",
                    ));
                }
            },
            b'"' => {
                return Err(IdempotencyRejection::InvalidKey(
                    "unescaped quote in string",
                ));
            }
            other => out.push(other),
        }
    }
    Ok(out)
}

/// Why the Idempotency-Key layer answered instead of the handler. Each
/// becomes an `application/problem+json` response with its own status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// `400`: the route requires a key and the request had none.
    #[error(
        "this request requires an Idempotency-Key header: generate a unique key (a UUID) per \
         operation and send the same key again when retrying it"
    )]
    MissingKey,
    /// `400`: the request carried more than one `Idempotency-Key` header.
    #[error("send exactly one Idempotency-Key header")]
    MultipleKeys,
    /// `400`: the key is malformed.
    #[error("invalid Idempotency-Key: {0}")]
    InvalidKey(&'static str),
    /// `400`: the key is longer than [`MAX_KEY_LEN`].
    #[error("Idempotency-Key is {len} characters long; the limit is {MAX_KEY_LEN}")]
    KeyTooLong {
        /// The key's length.
        len: usize,
    },
    /// `413`: the body is over the layer's buffering limit.
    #[error("request body is larger than the {limit}-byte limit for idempotent requests")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// `400`: the body could not be read.
    #[error("request body could not be read: {0}")]
    UnreadableBody(String),
    /// `409` + `Retry-After`: a request with this key is still being
    /// processed; retry later to get its response.
    #[error(
        "a request with this Idempotency-Key is still being processed; retry after a moment to \
         receive its response"
    )]
    InFlight {
        /// Sent as `Retry-After`.
        retry_after: Duration,
    },
    /// `422`: the key was used before for a different request.
    #[error(
        "this Idempotency-Key was already used for a different request (method, path, query, \
         headers or body differ); use a new key for a new operation"
    )]
    KeyReused,
    /// `503` + `Retry-After`: the handler was stopped because the key's
    /// lock could not be renewed (the store did not answer, or another
    /// request took the key over). Retrying with the same key is safe.
    #[error(
        "this request was stopped: its Idempotency-Key's lock could not be kept (the key store \
         did not confirm it in time, or another request took the key over); retry with the same key"
    )]
    LockLost {
        /// Sent as `Retry-After`.
        retry_after: Duration,
    },
    /// `503` + `Retry-After`: the handler ran, but the key store did not
    /// confirm that it kept the response (it failed, or another request
    /// took the key over after this one's lock passed). A fresh answer goes
    /// out only once its key is settled, so this request's is withheld;
    /// retrying with the same key gets the response that was kept.
    #[error(
        "this request ran, but its response could not be recorded under its Idempotency-Key (the \
         key store did not confirm it); retry with the same key to receive the recorded response"
    )]
    NotRecorded {
        /// Sent as `Retry-After`.
        retry_after: Duration,
    },
}

impl IdempotencyRejection {
    /// The HTTP status this refusal answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey
            | Self::MultipleKeys
            | Self::InvalidKey(_)
            | Self::KeyTooLong { .. }
            | Self::UnreadableBody(_) => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::InFlight { .. } => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::LockLost { .. } | Self::NotRecorded { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A short name for metrics and the problem type.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::MultipleKeys => "multiple-keys",
            Self::InvalidKey(_) => "invalid-key",
            Self::KeyTooLong { .. } => "key-too-long",
            Self::BodyTooLarge { .. } => "body-too-large",
            Self::UnreadableBody(_) => "unreadable-body",
            Self::InFlight { .. } => "in-flight",
            Self::KeyReused => "key-reused",
            Self::LockLost { .. } => "lock-lost",
            Self::NotRecorded { .. } => "not-recorded",
        }
    }

    /// The problem this refusal answers with.
    pub fn to_problem(&self) -> Problem {
        let mut problem = Problem::new(self.status(), self.to_string())
            .typed(&format!("idempotency:{}", self.kind()));
        if let Self::InFlight { retry_after }
        | Self::LockLost { retry_after }
        | Self::NotRecorded { retry_after } = self
        {
            problem = problem.with_retry_after(*retry_after);
        }
        problem
    }
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        metrics::counter!("keel_idempotency_refused_total", "reason" => self.kind()).increment(1);
        tracing::debug!(reason = self.kind(), status = %self.status(), "idempotent request refused");
        self.to_problem().into_response()
    }
}
