//! Problem details (RFC 9457) and the one mapping from errors to statuses.
//!
//! A client that gets `500 Internal Server Error` for a full bulkhead learns
//! nothing and retries at once. Here every refusal maps to the status that
//! tells it what to do: `503` + `Retry-After` (come back later), `429`
//! (slow down), `504` (the deadline passed), and bad input to a `4xx` with a
//! message saying what was wrong.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel_core::Rejected;
use serde::Serialize;

/// The media type of a problem body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem: a status, a short title, and a detail for humans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A URI reference naming the problem type (`about:blank` by default).
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary of the problem type.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong this time, and what to do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Seconds until trying again makes sense, also sent as `Retry-After`.
    #[serde(skip)]
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with a status and a detail; the title is the status reason.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            kind: "about:blank".to_owned(),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail: Some(detail.into()),
            retry_after: None,
        }
    }

    /// `400 Bad Request`.
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, detail)
    }

    /// `404 Not Found`.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, detail)
    }

    /// `500 Internal Server Error`, for bugs only; the detail is logged, not
    /// sent, so internals do not leak.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "internal error");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
    }

    /// Sets the problem type URI (e.g. `https://keel.dev/problems/circuit-open`).
    pub fn with_type(mut self, kind: impl Into<String>) -> Self {
        self.kind = kind.into();
        self
    }

    /// Sets `Retry-After`.
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The problem for a policy's refusal.
    pub fn from_rejected(rejected: &Rejected) -> Self {
        let status = match rejected {
            Rejected::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Rejected::DeadlineExceeded | Rejected::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        let mut problem = Self::new(status, rejected.to_string())
            .with_type(format!("urn:keel:problem:{}", rejected.kind()));
        problem.retry_after = rejected.retry_after();
        problem
    }
}

impl From<Rejected> for Problem {
    fn from(rejected: Rejected) -> Self {
        Self::from_rejected(&rejected)
    }
}

#[cfg(feature = "client")]
impl From<&keel_client::HttpCallError> for Problem {
    /// A failed dependency call, answered without leaking its URL or body.
    fn from(err: &keel_client::HttpCallError) -> Self {
        use keel_client::HttpCallError as E;
        match err {
            E::Rejected(rejected) => Self::from_rejected(rejected),
            E::Timeout { .. } => Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "a dependency did not answer in time",
            )
            .with_type("urn:keel:problem:dependency_timeout"),
            _ => {
                let mut problem = Self::new(
                    StatusCode::BAD_GATEWAY,
                    "a dependency failed; try again later",
                )
                .with_type("urn:keel:problem:dependency_failed");
                problem.retry_after = keel_core::Classify::retry_after(err);
                problem
            }
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            // Round up: "retry in 0 s" would invite an immediate retry.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_statuses_with_retry_after() {
        let open = Rejected::CircuitOpen {
            name: "payments".into(),
            retry_after: Duration::from_millis(1500),
        };
        let response = Problem::from(open).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        let limited = Rejected::RateLimited {
            name: "api".into(),
            retry_after: Duration::ZERO,
        };
        let response = Problem::from(limited).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(Problem::from(Rejected::DeadlineExceeded).status, 504);
    }
}
