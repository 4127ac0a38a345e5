//! [`DeadlineLayer`]: the caller's `grpc-timeout`, capped, as the deadline
//! the handler and its stream run under.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use keel_core::deadline::{GRPC_TIMEOUT_HEADER, grpc_timeout};
use keel_core::{BoxError, Deadline};
use keel_lifecycle::Drain;
use keel_policy::ConfigError;
use tonic::Status;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::Ending;

/// The longest deadline a caller can ask for by default: 30 s, as for HTTP.
pub const DEFAULT_MAX_DEADLINE: Duration = Duration::from_secs(30);

/// How much sooner than the header says the handler's deadline falls.
/// tonic's server starts its own timer from the same header a few
/// microseconds before this layer runs, on a timer wheel of 1 ms ticks;
/// when that timer fires first the caller reads `CANCELLED`. Ending one
/// tick earlier makes this layer's `DEADLINE_EXCEEDED` the answer.
const AHEAD_OF_TONIC: Duration = Duration::from_millis(1);

#[derive(Debug, Clone)]
struct Options {
    max: Duration,
    min_remaining: Duration,
    drain: Option<Drain>,
}

/// Runs each call under the deadline its caller sent in `grpc-timeout`,
/// capped at a maximum; see the [module docs](super).
///
/// | call | answer |
/// |---|---|
/// | no `grpc-timeout` | the handler runs with `max` from now |
/// | a timeout longer than `max` | the handler runs with `max` from now |
/// | a malformed `grpc-timeout` | `INVALID_ARGUMENT`; the handler never runs |
/// | no more than [`min_remaining`](Self::min_remaining) left on arrival | `DEADLINE_EXCEEDED`; the handler never runs |
/// | the deadline passes before the handler answers | `DEADLINE_EXCEEDED`; the handler's future is dropped |
/// | the deadline passes while a response stream is open | the stream ends after its last whole message with `DEADLINE_EXCEEDED` |
/// | the [`drain`](Self::drain) closes while a stream is open | the stream ends with `UNAVAILABLE`, for the client to resume |
///
/// tonic alone answers a passed deadline with `CANCELLED`, which a client
/// cannot tell from its own cancellation; every case here is the code the
/// gRPC specification names.
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
                drain: None,
            }),
        }
    }

    /// A layer whose deadlines are never more than `max` away; refused if
    /// `max` is zero (every call would be late).
    pub fn with_max(max: Duration) -> Result<Self, ConfigError> {
        if max.is_zero() {
            return Err(ConfigError::new(
                "max",
                "must be more than zero: a zero maximum fails every call with DEADLINE_EXCEEDED",
            ));
        }
        let mut layer = Self::new();
        Arc::make_mut(&mut layer.options).max = max;
        Ok(layer)
    }

    /// Answers `DEADLINE_EXCEEDED` without running the handler when no
    /// more than `min` is left on arrival (default zero: only when the
    /// deadline has passed). A handler with its own minimum uses
    /// [`require_remaining`](super::require_remaining).
    #[must_use]
    pub fn min_remaining(mut self, min: Duration) -> Self {
        Arc::make_mut(&mut self.options).min_remaining = min;
        self
    }

    /// Ends open response streams with `UNAVAILABLE` when `drain` closes
    /// (after the load balancers' notice), so that tonic's graceful
    /// shutdown finishes and clients resume elsewhere.
    #[must_use]
    pub fn drain(mut self, drain: &Drain) -> Self {
        Arc::make_mut(&mut self.options).drain = Some(drain.clone());
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

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for DeadlineService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let deadline = match inbound_deadline(request.headers(), self.options.max) {
            Ok(deadline) => deadline,
            Err(status) => return answer(status, "invalid_timeout"),
        };
        if deadline.remaining() <= self.options.min_remaining {
            return answer(
                Status::deadline_exceeded(
                    "the call's deadline (grpc-timeout) had passed, or too little of it was \
                     left, when it arrived: not started; call again with a later deadline",
                ),
                "expired_on_arrival",
            );
        }
        // The ready service goes into the future; a fresh clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let drain = self.options.drain.clone();
        Box::pin(async move {
            let head = deadline.scope(inner.call(request));
            match tokio::time::timeout_at(deadline.instant(), head).await {
                Ok(Ok(response)) => {
                    Ok(response.map(|body| Body::new(Ending::new(body, Some(deadline), drain))))
                }
                Ok(Err(err)) => Err(err),
                Err(_elapsed) => {
                    count("exceeded");
                    Ok(Status::deadline_exceeded(
                        "the call's deadline passed before the server answered; the work was \
                         cancelled. Call again with a later deadline, or ask for less",
                    )
                    .into_http())
                }
            }
        })
    }
}

fn answer<E: Send + 'static>(
    status: Status,
    outcome: &'static str,
) -> BoxFuture<Result<Response<Body>, E>> {
    count(outcome);
    tracing::debug!(code = ?status.code(), message = status.message(), "call refused before its handler");
    Box::pin(std::future::ready(Ok(status.into_http())))
}

/// The call's deadline: the caller's `grpc-timeout` from now, capped at
/// `max`; `max` from now without one.
fn inbound_deadline(headers: &HeaderMap, max: Duration) -> Result<Deadline, Status> {
    let timeout = match headers.get(GRPC_TIMEOUT_HEADER) {
        None => max,
        Some(value) => {
            let text = value.to_str().map_err(|_| {
                Status::invalid_argument("the grpc-timeout header is not visible ASCII")
            })?;
            grpc_timeout::decode(text)
                .map_err(|err| Status::invalid_argument(err.to_string()))?
                .min(max)
        }
    };
    Ok(Deadline::after(timeout.saturating_sub(AHEAD_OF_TONIC)))
}

fn count(outcome: &'static str) {
    metrics::counter!("keel_grpc_server_calls_total", "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(timeout: &str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(GRPC_TIMEOUT_HEADER, timeout.parse().unwrap());
        map
    }

    #[tokio::test(start_paused = true)]
    async fn the_header_is_capped_and_bad_ones_are_invalid_arguments() {
        let max = Duration::from_secs(10);
        let near = inbound_deadline(&headers("300m"), max).unwrap();
        assert_eq!(near.remaining(), Duration::from_millis(299));
        let absurd = inbound_deadline(&headers("99999999H"), max).unwrap();
        assert_eq!(absurd.remaining(), max - AHEAD_OF_TONIC);
        let none = inbound_deadline(&HeaderMap::new(), max).unwrap();
        assert_eq!(none.remaining(), max - AHEAD_OF_TONIC);
        for bad in ["", "10", "1x", "123456789S", "-1S", "1.5S"] {
            let status = inbound_deadline(&headers(bad), max).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
        let mut binary = HeaderMap::new();
        binary.insert(
            GRPC_TIMEOUT_HEADER,
            http::HeaderValue::from_bytes(b"1\xffS").unwrap(),
        );
        assert_eq!(
            inbound_deadline(&binary, max).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn a_zero_maximum_is_refused() {
        assert!(DeadlineLayer::with_max(Duration::ZERO).is_err());
        assert_eq!(DeadlineLayer::new().max(), DEFAULT_MAX_DEADLINE);
    }
}
