//! Cursors from outside input, and the refusals of the three transports,
//! each a `Problem` with the status that tells the client what to do.

use std::time::Duration;

use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use keel_store::StoreError;

use super::options::MAX_CURSOR_LEN;
use keel_http::problem::Problem;

/// A request the real-time endpoints refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RealtimeRejection {
    /// The application's [`Authenticate`](super::Authenticate) found no
    /// user: `401`.
    #[error("authentication required: sign in, then reconnect")]
    Unauthenticated,
    /// `after` or `Last-Event-ID` is not a sequence number: `400`.
    #[error(
        "invalid cursor in `{source_name}`: expected a sequence number (digits only, at most \
         {MAX_CURSOR_LEN}, as returned in `cursor` or the SSE `id`), got {shown:?}"
    )]
    InvalidCursor {
        /// Where the cursor came from (`after`, `Last-Event-ID`).
        source_name: &'static str,
        /// The start of the offending value.
        shown: String,
    },
    /// The server is draining for a restart: `503` with `Retry-After`.
    #[error("server is shutting down: reconnect (another instance will answer)")]
    Draining,
    /// The WebSocket `Origin` is not on the allow-list: `403`.
    #[error("origin not allowed to open a WebSocket here")]
    OriginNotAllowed,
    /// The client (or everyone) holds as many long-lived connections as
    /// allowed: `503` with `Retry-After`.
    #[error("too many open connections from this client; close one or retry later")]
    TooManyConnections,
    /// The WebSocket handshake did not offer the subprotocol: `400`.
    #[error("offer the WebSocket subprotocol `{0}` in Sec-WebSocket-Protocol")]
    Subprotocol(String),
}

impl RealtimeRejection {
    /// The status this refusal is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::InvalidCursor { .. } | Self::Subprotocol(_) => StatusCode::BAD_REQUEST,
            Self::Draining | Self::TooManyConnections => StatusCode::SERVICE_UNAVAILABLE,
            Self::OriginNotAllowed => StatusCode::FORBIDDEN,
        }
    }

    /// A short label for metrics.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::Unauthenticated => "unauthenticated",
            Self::InvalidCursor { .. } => "cursor",
            Self::Draining => "draining",
            Self::TooManyConnections => "connections",
            Self::OriginNotAllowed => "origin",
            Self::Subprotocol(_) => "subprotocol",
        }
    }
}

impl IntoResponse for RealtimeRejection {
    fn into_response(self) -> Response {
        let mut problem = Problem::new(self.status(), self.to_string());
        match self {
            Self::Draining => problem = problem.with_retry_after(Duration::from_secs(1)),
            Self::TooManyConnections => problem = problem.with_retry_after(Duration::from_secs(5)),
            _ => {}
        }
        problem.into_response()
    }
}

/// Logs and counts a refusal, and answers it.
pub(crate) fn refuse(transport: &'static str, rejection: RealtimeRejection) -> Response {
    tracing::debug!(
        transport,
        reason = rejection.reason(),
        "realtime request refused"
    );
    metrics::counter!("keel_realtime_rejected_total", "transport" => transport,
        "reason" => rejection.reason())
    .increment(1);
    rejection.into_response()
}

/// A store failure as a response: `503` + `Retry-After` when retrying can
/// help, `500` (logged, not detailed) otherwise.
pub(crate) fn store_failure(transport: &'static str, err: &StoreError) -> Response {
    metrics::counter!("keel_realtime_store_errors_total", "transport" => transport).increment(1);
    tracing::debug!(transport, "event log failed");
    Problem::from_store(err).into_response()
}

/// Parses a cursor: a non-negative decimal seq of at most
/// [`MAX_CURSOR_LEN`] digits.
pub(crate) fn parse_cursor(
    source_name: &'static str,
    value: &str,
) -> Result<i64, RealtimeRejection> {
    let valid = !value.is_empty()
        && value.len() <= MAX_CURSOR_LEN
        && value.bytes().all(|b| b.is_ascii_digit());
    valid
        .then(|| value.parse::<i64>().ok())
        .flatten()
        .ok_or_else(|| RealtimeRejection::InvalidCursor {
            source_name,
            shown: value.chars().take(MAX_CURSOR_LEN + 4).collect(),
        })
}

/// The `after` query parameter, if given (once).
pub(crate) fn after_param(parts: &Parts) -> Result<Option<i64>, RealtimeRejection> {
    let mut found = None;
    for pair in parts.uri.query().unwrap_or_default().split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "after" {
            continue;
        }
        if found.is_some() {
            return Err(RealtimeRejection::InvalidCursor {
                source_name: "after",
                shown: "(given more than once)".to_owned(),
            });
        }
        found = Some(parse_cursor("after", value)?);
    }
    Ok(found)
}

/// The SSE cursor: `Last-Event-ID` (a reconnecting browser sends it), else
/// `?after=`, else 0 (everything retained).
pub(crate) fn sse_cursor(parts: &Parts) -> Result<i64, RealtimeRejection> {
    let header = parts.headers.get("last-event-id");
    match header {
        Some(value) if !value.is_empty() => {
            let text = value
                .to_str()
                .map_err(|_| RealtimeRejection::InvalidCursor {
                    source_name: "Last-Event-ID",
                    shown: "(not visible ASCII)".to_owned(),
                })?;
            parse_cursor("Last-Event-ID", text.trim())
        }
        _ => Ok(after_param(parts)?.unwrap_or(0)),
    }
}
