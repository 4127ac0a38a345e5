//! Problem details (RFC 9457) and the one mapping from errors to statuses.
//!
//! A client that gets `500 Internal Server Error` for a full bulkhead learns
//! nothing and retries at once. Here every refusal maps to the status that
//! tells it what to do: `503` + `Retry-After` (come back later), `429`
//! (slow down), `504` (the deadline passed), and bad input to a `4xx` with a
//! message saying what was wrong.
//!
//! Problem types follow one scheme, [`problem_type`]:
//! `urn:keel:problem:<name>` for a refusal any component may give (a
//! policy's, the deadline's, the store's, a dependency's), and
//! `urn:keel:problem:<area>:<name>` for one component's own
//! (`idempotency:key_reused`, `jobs:expired`, `webhook:stale_timestamp`),
//! names in snake case. [`JsonBody`] reads a JSON request body and refuses
//! a bad one with a problem, so handlers never parse JSON by hand.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use keel_core::Rejected;
#[cfg(feature = "outbox")]
use keel_messaging::outbox::OutboxError;
use keel_store::StoreError;
use serde::Serialize;

mod json;

pub use json::{JsonBody, parse_json};

/// A problem type in Keel's one scheme: `urn:keel:problem:` and `name`,
/// which is a snake-case name or `area:name` (a `-` becomes `_`).
///
/// ```
/// use keel_http::problem::problem_type;
///
/// assert_eq!(problem_type("circuit_open"), "urn:keel:problem:circuit_open");
/// assert_eq!(problem_type("jobs:key-reused"), "urn:keel:problem:jobs:key_reused");
/// ```
pub fn problem_type(name: &str) -> String {
    format!("urn:keel:problem:{}", name.replace('-', "_"))
}

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

    /// Sets the problem type to [`problem_type`]`(name)`.
    pub fn typed(self, name: &str) -> Self {
        self.with_type(problem_type(name))
    }

    /// Sets `Retry-After`.
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The problem for a policy's refusal, its status from
    /// [`keel_core::status`], the table the gRPC edge answers from too.
    pub fn from_rejected(rejected: &Rejected) -> Self {
        let status = StatusCode::from_u16(keel_core::status::http_status(rejected))
            .unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut problem = Self::new(status, rejected.to_string()).typed(rejected.kind());
        problem.retry_after = rejected.retry_after();
        problem
    }

    /// The problem for a store failure, the same from every component:
    ///
    /// | failure | status | type |
    /// |---|---|---|
    /// | unavailable (nothing committed) | `503` + `Retry-After: 1` | `store_unavailable` |
    /// | commit outcome unknown (a lost `COMMIT`) | `503` + `Retry-After: 1` | `commit_outcome_unknown` |
    /// | conflict | `409` | `conflict` |
    /// | not found | `404` | `not_found` |
    /// | anything else | `500`, logged, not detailed | `internal` |
    ///
    /// A lost commit is a `503`, never a `500`: the client's retry is what
    /// resolves it (with the same `Idempotency-Key` it finds what landed),
    /// and the detail says to read back before writing anew.
    pub fn from_store(err: &StoreError) -> Self {
        let status = Self::store_status(err);
        let retry_soon = |name: &str, detail: &str| {
            Self::new(status, detail)
                .typed(name)
                .with_retry_after(Duration::from_secs(1))
        };
        match err {
            StoreError::Unavailable(_) => {
                tracing::warn!(error = %err, "store unavailable");
                retry_soon(
                    "store_unavailable",
                    "the store is unavailable; nothing was committed, retry shortly",
                )
            }
            StoreError::OutcomeUnknown(_) => {
                tracing::error!(error = %err, "commit outcome unknown");
                retry_soon(
                    "commit_outcome_unknown",
                    "the write may or may not have been committed; retry with the same \
                     Idempotency-Key, or read back before writing again",
                )
            }
            StoreError::Conflict(what) => Self::new(status, what.clone()).typed("conflict"),
            StoreError::NotFound(what) => Self::new(status, what.clone()).typed("not_found"),
            _ => Self::internal(err).typed("internal"),
        }
    }

    /// The status [`from_store`](Self::from_store) answers `err` with, for
    /// an error type whose own `status()` includes a store failure.
    pub fn store_status(err: &StoreError) -> StatusCode {
        match err {
            StoreError::Unavailable(_) | StoreError::OutcomeUnknown(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            StoreError::Conflict(_) => StatusCode::CONFLICT,
            StoreError::NotFound(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The status [`from_outbox`](Self::from_outbox) answers `err` with.
    #[cfg(feature = "outbox")]
    pub fn outbox_status(err: &OutboxError) -> StatusCode {
        match err {
            OutboxError::Store(store) => Self::store_status(store),
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem for an outbox append that failed: the store's failure is
    /// [`from_store`](Self::from_store)'s problem; an event the outbox
    /// refused (invalid, too large, unpublishable on the configured broker)
    /// is the server's own bug, a `500` whose detail is logged, not sent.
    /// A handler whose event carries the client's data and can tell it was
    /// too large answers its own `413` or `422` before appending.
    #[cfg(feature = "outbox")]
    pub fn from_outbox(err: &OutboxError) -> Self {
        match err {
            OutboxError::Store(store) => Self::from_store(store),
            other => Self::internal(other).typed("internal"),
        }
    }
}

#[cfg(feature = "outbox")]
impl From<&OutboxError> for Problem {
    fn from(err: &OutboxError) -> Self {
        Self::from_outbox(err)
    }
}

impl From<&StoreError> for Problem {
    fn from(err: &StoreError) -> Self {
        Self::from_store(err)
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
            .typed("dependency_timeout"),
            _ => {
                let mut problem = Self::new(
                    StatusCode::BAD_GATEWAY,
                    "a dependency failed; try again later",
                )
                .typed("dependency_failed");
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
        let open = Rejected::circuit_open("payments", Duration::from_millis(1500));
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

    #[test]
    fn a_lost_commit_is_a_503_to_retry_not_a_500() {
        let lost = StoreError::OutcomeUnknown("connection reset during COMMIT".into());
        let problem = Problem::from(&lost);
        assert_eq!(problem.status, 503);
        assert_eq!(
            problem.kind,
            keel_core::status::COMMIT_OUTCOME_UNKNOWN_PROBLEM
        );
        assert_eq!(problem.retry_after, Some(Duration::from_secs(1)));
        let down = Problem::from(&StoreError::Unavailable("busy".into()));
        assert_eq!(
            (down.status, down.kind.as_str()),
            (503, "urn:keel:problem:store_unavailable")
        );
        assert_eq!(
            Problem::from(&StoreError::Conflict("id".into())).status,
            409
        );
        assert_eq!(
            Problem::from(&StoreError::NotFound("id".into())).status,
            404
        );
        let lost_in_outbox = OutboxError::Store(StoreError::OutcomeUnknown("reset".into()));
        assert_eq!(
            Problem::from(&lost_in_outbox).kind,
            problem.kind,
            "the same everywhere"
        );
        let bug = Problem::from(&StoreError::Other("schema".into()));
        assert_eq!(bug.status, 500);
        assert_eq!(
            bug.detail.as_deref(),
            Some("internal error"),
            "internals never leak"
        );
    }
}
