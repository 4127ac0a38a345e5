//! [`HttpCallError`]: what went wrong with an outgoing HTTP call, classified
//! for retries and breakers.

use std::time::Duration;

use http::{HeaderMap, StatusCode, header};
use keel_core::{Classify, ErrorClass, PolicyError, Rejected};

/// Why an outgoing call through a [`PropagatingClient`](super::PropagatingClient)
/// or a [`Dependency`](super::Dependency) failed.
///
/// Its [`Classify`] class decides what retries and breakers do:
///
/// | failure | class | retried | counts against the breaker |
/// |---|---|---|---|
/// | [`Connect`](Self::Connect): no connection | `Retryable` | yes | yes |
/// | [`Status`](Self::Status) 503 or 429: not processed | `Retryable`, with its `Retry-After` | yes | yes |
/// | [`Status`](Self::Status) other 5xx (500, 502, 504), or a problem of type [`COMMIT_OUTCOME_UNKNOWN_PROBLEM`](keel_core::status::COMMIT_OUTCOME_UNKNOWN_PROBLEM) whatever its status: may have been processed | `OutcomeUnknown`, with its `Retry-After` | only if idempotent | yes |
/// | [`Status`](Self::Status) other 4xx | `Permanent` | no | no (the dependency answered) |
/// | [`Timeout`](Self::Timeout) after sending | `OutcomeUnknown` | only if idempotent | yes |
/// | [`Transport`](Self::Transport) after sending | `OutcomeUnknown` | only if idempotent | yes |
/// | [`Invalid`](Self::Invalid) request | `Permanent` | no | no |
/// | [`Rejected`](Self::Rejected) by a policy | `Rejected` | no | no |
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpCallError {
    /// A policy refused the call or stopped it: too little time left before
    /// the deadline, circuit open, bulkhead full, timed out.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// No connection could be made: the request never left, so it is safe
    /// to try again (elsewhere, or later).
    #[error("could not connect: {source}; the request was not sent, so it is safe to retry")]
    Connect {
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The request was sent and no complete answer came within the time
    /// allowed (`min(own timeout, time left before the deadline)`). It may
    /// or may not have taken effect.
    #[error(
        "no answer within {after:?}: {source}; the request may or may not have taken effect, \
         so only retry it if it is idempotent"
    )]
    Timeout {
        /// The time allowed.
        after: Duration,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The connection failed after the request was sent (reset, closed
    /// mid-response). It may or may not have taken effect.
    #[error(
        "the connection failed after the request was sent: {source}; it may or may not have \
         taken effect, so only retry it if it is idempotent"
    )]
    Transport {
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The dependency answered with an error status.
    #[error("{url} answered {status}{}", retry_after.map(|d| format!(" (retry after {d:?})")).unwrap_or_default())]
    Status {
        /// The status.
        status: StatusCode,
        /// The URL called.
        url: String,
        /// The `Retry-After` it sent, if any, as a delay from now.
        retry_after: Option<Duration>,
        /// The start of the response body (at most
        /// [`ERROR_BODY_LIMIT`](super::ERROR_BODY_LIMIT) bytes, lossily
        /// decoded), for logs and problem details.
        body: String,
    },
    /// The request could not be built or sent as asked (a bad URL, a body
    /// that cannot be cloned for a retry, a redirect loop). Fix the caller.
    #[error("invalid request: {source}; fix the request, retrying will not help")]
    Invalid {
        /// The error.
        #[source]
        source: reqwest::Error,
    },
}

impl HttpCallError {
    /// The status the dependency answered with, if it answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The policy's refusal, if that is what this is.
    pub fn rejected(&self) -> Option<&Rejected> {
        match self {
            Self::Rejected(rejected) => Some(rejected),
            _ => None,
        }
    }

    /// Classifies a transport error from reqwest; `allowed` is the time the
    /// request was given.
    pub(crate) fn from_reqwest(source: reqwest::Error, allowed: Duration) -> Self {
        if source.is_builder() || source.is_redirect() {
            Self::Invalid { source }
        } else if source.is_connect() {
            // A connect timeout is a connect error: nothing was sent.
            Self::Connect { source }
        } else if source.is_timeout() {
            Self::Timeout {
                after: allowed,
                source,
            }
        } else {
            Self::Transport { source }
        }
    }
}

impl Classify for HttpCallError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Rejected(rejected) => rejected.class(),
            Self::Connect { .. } => ErrorClass::Retryable,
            Self::Timeout { .. } | Self::Transport { .. } => ErrorClass::OutcomeUnknown,
            Self::Status { status, body, .. } => status_class(*status, body),
            Self::Invalid { .. } => ErrorClass::Permanent,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Rejected(rejected) => rejected.retry_after(),
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What an error status says about the request: `429` and `503` that it
/// was not processed (RFC 9110), unless the body is a problem whose type
/// says its commit's outcome is unknown (Keel's own `503` for a lost
/// `COMMIT`); any other `5xx` that the server, or one behind a gateway, may
/// have acted before failing; a `4xx` that it was refused.
fn status_class(status: StatusCode, body: &str) -> ErrorClass {
    if status.is_server_error() && names_outcome_unknown(body) {
        return ErrorClass::OutcomeUnknown;
    }
    match status {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => ErrorClass::Retryable,
        status if status.is_server_error() => ErrorClass::OutcomeUnknown,
        _ => ErrorClass::Permanent,
    }
}

/// Whether a problem document's `type` member is
/// [`COMMIT_OUTCOME_UNKNOWN_PROBLEM`](keel_core::status::COMMIT_OUTCOME_UNKNOWN_PROBLEM):
/// the member's name, a colon and the URN as a JSON string, so that a
/// `detail` quoting the URN is not taken for it. (The body may be cut at
/// [`ERROR_BODY_LIMIT`](super::ERROR_BODY_LIMIT), so it is not parsed.)
fn names_outcome_unknown(body: &str) -> bool {
    let urn = keel_core::status::COMMIT_OUTCOME_UNKNOWN_PROBLEM;
    body.match_indices("\"type\"").any(|(at, member)| {
        body[at + member.len()..]
            .trim_start()
            .strip_prefix(':')
            .map(str::trim_start)
            .and_then(|value| value.strip_prefix('"'))
            .is_some_and(|value| {
                value
                    .strip_prefix(urn)
                    .is_some_and(|rest| rest.starts_with('"'))
            })
    })
}

impl From<PolicyError<HttpCallError>> for HttpCallError {
    /// Flattens a policy's result: the call's own error as itself, a
    /// refusal as [`HttpCallError::Rejected`].
    fn from(err: PolicyError<HttpCallError>) -> Self {
        match err {
            PolicyError::Inner(inner) => inner,
            PolicyError::Rejected(rejected) => Self::Rejected(rejected),
        }
    }
}

/// The longest `Retry-After` read from a response: a day. Longer values
/// are clamped (the retry policy gives up on anything past its own bound).
const RETRY_AFTER_CAP: Duration = Duration::from_secs(86_400);

/// Reads `Retry-After` as a delay from now: delay-seconds (`120`) or an
/// HTTP-date (`Sun, 06 Nov 1994 08:49:37 GMT`, zero if already past).
/// `None` if absent or malformed; capped at one day.
///
/// ```
/// use std::time::Duration;
/// use http::HeaderMap;
/// use keel_client::parse_retry_after;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "3".parse().unwrap());
/// assert_eq!(parse_retry_after(&headers), Some(Duration::from_secs(3)));
/// headers.insert("retry-after", "Sun, 06 Nov 1994 08:49:37 GMT".parse().unwrap());
/// assert_eq!(parse_retry_after(&headers), Some(Duration::ZERO));
/// headers.insert("retry-after", "soon".parse().unwrap());
/// assert_eq!(parse_retry_after(&headers), None);
/// ```
pub fn parse_retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    let delay = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
        let at_ms = u64::try_from(at.timestamp_millis()).unwrap_or(0);
        Duration::from_millis(at_ms.saturating_sub(keel_core::clock::unix_millis()))
    };
    Some(delay.min(RETRY_AFTER_CAP))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> HttpCallError {
        HttpCallError::Status {
            status: StatusCode::from_u16(code).unwrap(),
            url: "http://127.0.0.1/x".to_owned(),
            retry_after: None,
            body: String::new(),
        }
    }

    #[test]
    fn statuses_are_classified() {
        assert_eq!(status(503).class(), ErrorClass::Retryable);
        assert_eq!(status(429).class(), ErrorClass::Retryable);
        for maybe_processed in [500, 502, 504] {
            assert_eq!(
                status(maybe_processed).class(),
                ErrorClass::OutcomeUnknown,
                "{maybe_processed}"
            );
        }
        assert_eq!(status(404).class(), ErrorClass::Permanent);
        assert_eq!(status(400).class(), ErrorClass::Permanent);
        let refused = HttpCallError::from(PolicyError::Rejected(Rejected::DeadlineExceeded));
        assert_eq!(refused.class(), ErrorClass::Rejected);
        assert_eq!(refused.rejected(), Some(&Rejected::DeadlineExceeded));
    }

    /// Keel's own answer to a lost `COMMIT` is a `503` with
    /// `Retry-After`, which alone would read "not processed, retry
    /// freely": its problem type says the write may have committed.
    #[test]
    fn a_commit_of_unknown_outcome_is_not_read_as_nothing_happened() {
        let lost_commit = HttpCallError::Status {
            status: StatusCode::SERVICE_UNAVAILABLE,
            url: "http://127.0.0.1/orders".to_owned(),
            retry_after: Some(Duration::from_secs(1)),
            body: r#"{"type":"urn:keel:problem:commit_outcome_unknown","status":503}"#.to_owned(),
        };
        assert_eq!(lost_commit.class(), ErrorClass::OutcomeUnknown);
        assert_eq!(lost_commit.retry_after(), Some(Duration::from_secs(1)));
        // Only the problem's type counts, and only on a 5xx.
        let quoted = HttpCallError::Status {
            status: StatusCode::SERVICE_UNAVAILABLE,
            url: "http://127.0.0.1/orders".to_owned(),
            retry_after: None,
            body: r#"{"type":"urn:keel:problem:store_unavailable","detail":"not urn:keel:problem:commit_outcome_unknown"}"#.to_owned(),
        };
        assert_eq!(quoted.class(), ErrorClass::Retryable);
        let refused = HttpCallError::Status {
            status: StatusCode::BAD_REQUEST,
            url: "http://127.0.0.1/orders".to_owned(),
            retry_after: None,
            body: r#"{"type": "urn:keel:problem:commit_outcome_unknown"}"#.to_owned(),
        };
        assert_eq!(refused.class(), ErrorClass::Permanent);
    }

    #[test]
    fn retry_after_forms() {
        let mut headers = HeaderMap::new();
        assert_eq!(parse_retry_after(&headers), None);
        headers.insert(
            header::RETRY_AFTER,
            "99999999999999999999999".parse().unwrap(),
        );
        assert_eq!(parse_retry_after(&headers), Some(RETRY_AFTER_CAP));
        let future = chrono::DateTime::from_timestamp_millis(
            i64::try_from(keel_core::clock::unix_millis()).unwrap() + 120_000,
        )
        .unwrap()
        .format("%a, %d %b %Y %H:%M:%S GMT")
        .to_string();
        headers.insert(header::RETRY_AFTER, future.parse().unwrap());
        let delay = parse_retry_after(&headers).unwrap();
        assert!(
            delay > Duration::from_secs(110) && delay <= Duration::from_secs(120),
            "{delay:?}"
        );
        headers.insert(header::RETRY_AFTER, "-5".parse().unwrap());
        assert_eq!(parse_retry_after(&headers), None);
    }
}
