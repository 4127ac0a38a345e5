//! [`DeadlineLayer`]: the inbound `X-Request-Deadline-Unix-Ms`, capped, as
//! the deadline the handler runs under.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::response::IntoResponse;
use keel_core::deadline::DEADLINE_HEADER;
use keel_core::{BoxError, Deadline};
use keel_policy::ConfigError;
use tower_layer::Layer;
use tower_service::Service;

use super::ResponseFuture;
use crate::problem::Problem;

/// The longest deadline a caller can ask for by default: 30 s. A caller
/// asking for more gets this.
pub const DEFAULT_MAX_DEADLINE: Duration = Duration::from_secs(30);

/// The problem type of a malformed deadline header.
const INVALID_DEADLINE: &str = "urn:keel:problem:invalid_deadline";
/// The problem type of a request whose deadline passed.
const DEADLINE_EXCEEDED: &str = "urn:keel:problem:deadline_exceeded";

#[derive(Debug, Clone)]
struct Options {
    max: Duration,
    min_remaining: Duration,
}

/// Runs each request under the deadline its caller sent, capped at a
/// maximum; see the [module docs](super).
///
/// | request | answer |
/// |---|---|
/// | no `X-Request-Deadline-Unix-Ms` | the handler runs with `max` from now |
/// | a deadline further away than `max` | the handler runs with `max` from now |
/// | a deadline within `max` | the handler runs with it |
/// | not a whole number of Unix milliseconds, or not ASCII | `400` problem |
/// | already passed (or no more than [`min_remaining`](Self::min_remaining) left) | `504` problem; the handler never runs |
/// | the deadline passes while the handler runs | `504` problem; the handler's future is dropped |
///
/// With several deadline headers the earliest wins. The deadline covers the
/// handler up to its response head: a streaming body is not cut off.
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, body::Body, http::{Request, StatusCode}, routing::get};
/// use keel_http::propagation::DeadlineLayer;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new()
///     .route("/", get(|| async {
///         // Everything the handler calls sees the deadline.
///         let left = keel_core::Deadline::current_remaining().unwrap();
///         assert!(left <= Duration::from_secs(2));
///         "ok"
///     }))
///     .layer(DeadlineLayer::with_max(Duration::from_secs(2)).unwrap());
///
/// let an_hour = keel_core::clock::unix_millis() + 3_600_000;
/// let request = Request::get("/")
///     .header("x-request-deadline-unix-ms", an_hour.to_string())
///     .body(Body::empty())
///     .unwrap();
/// assert_eq!(app.clone().oneshot(request).await.unwrap().status(), StatusCode::OK);
///
/// let malformed = Request::get("/")
///     .header("x-request-deadline-unix-ms", "soon")
///     .body(Body::empty())
///     .unwrap();
/// assert_eq!(app.oneshot(malformed).await.unwrap().status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct DeadlineLayer {
    options: Arc<Options>,
}

impl Default for DeadlineLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl DeadlineLayer {
    /// A layer with the default maximum, [`DEFAULT_MAX_DEADLINE`] (30 s).
    pub fn new() -> Self {
        Self {
            options: Arc::new(Options {
                max: DEFAULT_MAX_DEADLINE,
                min_remaining: Duration::ZERO,
            }),
        }
    }

    /// A layer whose deadlines are never more than `max` away; refused if
    /// `max` is zero (every request would be late).
    pub fn with_max(max: Duration) -> Result<Self, ConfigError> {
        if max.is_zero() {
            return Err(ConfigError::new(
                "max",
                "must be more than zero: a zero maximum fails every request with 504",
            ));
        }
        Ok(Self {
            options: Arc::new(Options {
                max,
                min_remaining: Duration::ZERO,
            }),
        })
    }

    /// Answers `504` without running the handler when no more than `min`
    /// is left on arrival (default zero: only when the deadline has passed).
    /// Worth setting to a handler's least useful duration: a request that
    /// arrives with 3 ms left will not be answered in time anyway.
    #[must_use]
    pub fn min_remaining(mut self, min: Duration) -> Self {
        Arc::make_mut(&mut self.options).min_remaining = min;
        self
    }

    /// The maximum deadline.
    pub fn max(&self) -> Duration {
        self.options.max
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadlineService {
            inner,
            options: Arc::clone(&self.options),
        }
    }
}

/// The service made by [`DeadlineLayer`].
#[derive(Debug, Clone)]
pub struct DeadlineService<S> {
    inner: S,
    options: Arc<Options>,
}

impl<S> DeadlineService<S> {
    keel_core::inner_service_accessors!(inner: S);
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for DeadlineService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let deadline = match inbound_deadline(request.headers(), self.options.max) {
            Ok(deadline) => deadline,
            Err(problem) => return ResponseFuture::new(async move { Ok(problem.into_response()) }),
        };
        if deadline.remaining() <= self.options.min_remaining {
            count("expired_on_arrival");
            tracing::debug!(
                deadline_unix_ms = deadline.to_unix_millis(),
                "request arrived after its deadline: not started"
            );
            let problem = Problem::new(
                StatusCode::GATEWAY_TIMEOUT,
                "the request's deadline (X-Request-Deadline-Unix-Ms) had already passed when it \
                 arrived, so it was not started; send a later deadline",
            )
            .with_type(DEADLINE_EXCEEDED);
            return ResponseFuture::new(async move { Ok(problem.into_response()) });
        }
        // The ready service goes into the future; a fresh clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(async move {
            let mut guard = CancelGuard { armed: true };
            let handler = deadline.scope(async move { inner.call(request).await });
            let outcome = tokio::time::timeout_at(deadline.instant(), handler).await;
            guard.armed = false;
            match outcome {
                Ok(result) => result.map(|response| response.map(Body::new)),
                Err(_elapsed) => {
                    count("exceeded");
                    tracing::debug!("deadline passed while the handler ran: handler cancelled");
                    Ok(Problem::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "the request's deadline passed before it was answered; the work was \
                         cancelled. Retry with a later deadline, or ask for less",
                    )
                    .with_type(DEADLINE_EXCEEDED)
                    .into_response())
                }
            }
        })
    }
}

/// The request's deadline: the earliest valid header value, capped at
/// `max` from now; `max` from now without a header.
fn inbound_deadline(headers: &HeaderMap, max: Duration) -> Result<Deadline, Problem> {
    let mut earliest: Option<Deadline> = None;
    for value in headers.get_all(DEADLINE_HEADER) {
        let text = value.to_str().map_err(|_| {
            malformed("the X-Request-Deadline-Unix-Ms header is not visible ASCII".to_owned())
        })?;
        let deadline = Deadline::parse_header(text).map_err(|err| malformed(err.to_string()))?;
        earliest = Some(deadline.min_with(earliest));
    }
    Ok(match earliest {
        Some(deadline) => deadline.capped(max),
        None => Deadline::after(max),
    })
}

fn malformed(detail: String) -> Problem {
    count("malformed");
    tracing::debug!(%detail, "malformed deadline header: 400");
    Problem::bad_request(detail).with_type(INVALID_DEADLINE)
}

fn count(outcome: &'static str) {
    metrics::counter!("keel_http_deadline_total", "outcome" => outcome).increment(1);
}

/// Counts requests whose future was dropped before it finished: the client
/// disconnected (or the server aborted the connection).
struct CancelGuard {
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            metrics::counter!("keel_http_requests_cancelled_total").increment(1);
            tracing::debug!(
                "request cancelled before it was answered (client disconnected): \
                 all work below it was dropped"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn earliest_header_wins_and_is_capped() {
        let now = keel_core::clock::unix_millis();
        let mut headers = HeaderMap::new();
        headers.append(DEADLINE_HEADER, (now + 5_000).to_string().parse().unwrap());
        headers.append(DEADLINE_HEADER, (now + 1_000).to_string().parse().unwrap());
        let d = inbound_deadline(&headers, Duration::from_secs(30)).unwrap();
        assert!(d.remaining() <= Duration::from_millis(1_000));
        let capped = inbound_deadline(&headers, Duration::from_millis(300)).unwrap();
        assert!(capped.remaining() <= Duration::from_millis(300));
        let none = inbound_deadline(&HeaderMap::new(), Duration::from_secs(2)).unwrap();
        assert_eq!(none.remaining(), Duration::from_secs(2));
    }

    #[test]
    fn malformed_headers_are_400() {
        for bad in ["", "soon", "-1", "1.5", "99999999999999999999999"] {
            let mut headers = HeaderMap::new();
            headers.insert(DEADLINE_HEADER, bad.parse().unwrap());
            let problem = inbound_deadline(&headers, DEFAULT_MAX_DEADLINE).unwrap_err();
            assert_eq!(problem.status, 400, "{bad:?}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            DEADLINE_HEADER,
            axum::http::HeaderValue::from_bytes(b"17\xff").unwrap(),
        );
        assert_eq!(
            inbound_deadline(&headers, DEFAULT_MAX_DEADLINE)
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn a_zero_maximum_is_refused() {
        assert_eq!(
            DeadlineLayer::with_max(Duration::ZERO).unwrap_err().field,
            "max"
        );
        let layer = DeadlineLayer::new().min_remaining(Duration::from_millis(5));
        assert_eq!(layer.options.min_remaining, Duration::from_millis(5));
        assert_eq!(layer.max(), DEFAULT_MAX_DEADLINE);
    }
}
