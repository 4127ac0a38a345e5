//! The client half: the current deadline as `grpc-timeout`, the current
//! trace as `traceparent`, and Keel's refusals as the statuses they mean.
//!
//! [`PropagationLayer`] goes outermost on a tonic `Channel`, above Keel's
//! policies, so that everything below it (retries, breaker, timeout) runs
//! within the call's deadline and every refusal reaches the caller as its
//! gRPC code:
//!
//! ```
//! use std::time::Duration;
//! use keel_grpc::client::PropagationLayer;
//! use keel_grpc::replay::{ChannelBodyLayer, ReplayBodyLayer};
//! use keel_policy::breaker::CircuitBreaker;
//! use keel_policy::bulkhead::{Bulkhead, BulkheadLayer};
//! use keel_policy::retry::{grpc_verdict, Retry};
//! use keel_policy::timeout::Timeout;
//! use tonic_health::pb::health_client::HealthClient;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051").connect_lazy();
//! let retry = Retry::builder("shipping")
//!     .max_attempts(3)
//!     .retry_on_result(grpc_verdict::<tonic::body::Body>)
//!     .build()?;
//! let breaker = CircuitBreaker::builder("shipping").build()?;
//! let per_attempt = Timeout::builder("shipping").timeout(Duration::from_millis(300)).build()?;
//! let bulkhead = Bulkhead::builder("shipping").max_concurrent(32).build()?;
//! let stack = tower::ServiceBuilder::new()
//!     .layer(PropagationLayer::new())
//!     // Retries (and hedges) resend the request: its body is kept.
//!     .layer(ReplayBodyLayer::new())
//!     .layer(retry.layer())
//!     .layer(breaker.grpc_layer())
//!     .layer(per_attempt.layer())
//!     .layer(BulkheadLayer::new(bulkhead))
//!     .layer(ChannelBodyLayer)
//!     .service(channel);
//! let mut client = HealthClient::new(stack);
//! # let _ = &mut client;
//! # Ok(()) }
//! ```
//!
//! A hedge (`keel_policy::hedge`) goes where the retry is, on idempotent
//! calls only. The breaker judges statuses with `GrpcStatus` and the retry
//! with `grpc_verdict`, which honours the server's
//! `grpc-retry-pushback-ms`; refusals below (a breaker open, a bulkhead
//! full, a timeout) come out of [`PropagationLayer`] as `UNAVAILABLE` or
//! `DEADLINE_EXCEEDED`, never tonic's `UNKNOWN`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use keel_core::deadline::{GRPC_TIMEOUT_HEADER, MIN_TIME_TO_START, grpc_timeout};
use keel_core::trace::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
use keel_core::{BoxError, Deadline};
use tonic::Status;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument as _;

use crate::body::Ending;

/// Sends the current deadline and trace with every call, refuses to send
/// what cannot finish in time, and turns every error from below into the
/// [`Status`] it means ([`crate::status::from_error`]).
///
/// | current context | the call |
/// |---|---|
/// | a deadline with more than `min_time_to_start` left | sent with `grpc-timeout` (the earlier of the deadline and a timeout tonic already set); cut off with `DEADLINE_EXCEEDED` when it passes, stream included |
/// | a deadline with no more than that left | not sent: `DEADLINE_EXCEEDED` |
/// | no deadline | sent as it is |
/// | a trace context | `traceparent` of a child span; a new trace without one |
#[derive(Debug, Clone, Copy)]
pub struct PropagationLayer {
    min_time_to_start: Duration,
    dependency: Option<keel_core::Name>,
}

impl Default for PropagationLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl PropagationLayer {
    /// A layer that refuses to send with [`MIN_TIME_TO_START`] (50 ms) or
    /// less left.
    pub fn new() -> Self {
        Self {
            min_time_to_start: MIN_TIME_TO_START,
            dependency: None,
        }
    }

    /// Also records each call, as keel-client does for an HTTP
    /// dependency, in `keel_client_call_duration_seconds` by `dependency`
    /// (`name`) and `outcome` (`ok`, or `error` for a failed call or an
    /// error status in the response's headers): the figures the console's
    /// history and the dependency alerts read, whatever protocol the
    /// dependency speaks.
    #[must_use]
    pub fn dependency(mut self, name: impl Into<keel_core::Name>) -> Self {
        self.dependency = Some(name.into());
        self
    }

    /// Refuses to send with `min` or less left before the deadline.
    #[must_use]
    pub fn min_time_to_start(mut self, min: Duration) -> Self {
        self.min_time_to_start = min;
        self
    }
}

impl<S> Layer<S> for PropagationLayer {
    type Service = Propagation<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Propagation {
            inner,
            min_time_to_start: self.min_time_to_start,
            dependency: self.dependency,
        }
    }
}

/// The service made by [`PropagationLayer`].
#[derive(Debug, Clone)]
pub struct Propagation<S> {
    inner: S,
    min_time_to_start: Duration,
    dependency: Option<keel_core::Name>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Propagation<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    // A concrete error, not a `BoxError`: the caller gets the status as it
    // is, and a generated client's future stays provably `Send` (with a
    // boxed error it trips rustc's higher-ranked lifetime inference).
    type Error = Status;
    type Future = BoxFuture<Result<Response<Body>, Status>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner
            .poll_ready(cx)
            .map_err(|err| as_status(err.into()))
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let deadline = Deadline::current();
        if let Some(Err(status)) =
            deadline.map(|d| send_timeout(&mut request, d, self.min_time_to_start))
        {
            count("too_late_to_send");
            return Box::pin(std::future::ready(Err(status)));
        }
        let client_span = crate::span::rpc(request.uri().path(), "client");
        let (span, state) = keel_core::trace::span::outgoing(&client_span);
        if let Ok(value) = HeaderValue::try_from(span.to_string()) {
            request.headers_mut().insert(TRACEPARENT_HEADER, value);
        }
        if let Some(state) = state
            && let Ok(value) = HeaderValue::try_from(state.as_str())
        {
            request.headers_mut().insert(TRACESTATE_HEADER, value);
        }
        let method = request.uri().path().to_owned();
        let call = self.inner.call(request);
        let started = keel_core::clock::now();
        let dependency = self.dependency;
        let answer = async move {
            let answered = match deadline {
                None => call.await,
                Some(deadline) => match tokio::time::timeout_at(deadline.instant(), call).await {
                    Ok(answered) => answered,
                    Err(_elapsed) => {
                        count("deadline_passed");
                        let passed = Err(Status::deadline_exceeded(
                            "the call's deadline passed before the server answered",
                        ));
                        record_call(dependency, &passed, seconds_since(started));
                        return passed;
                    }
                },
            };
            let answered = match answered {
                Ok(response) => {
                    Ok(response.map(|body| Body::new(Ending::new(body, deadline, None))))
                }
                Err(err) => Err(as_status(err.into())),
            };
            let seconds = seconds_since(started);
            record_call(dependency, &answered, seconds);
            record_latency(method, &answered, seconds);
            answered
        };
        Box::pin(answer.instrument(client_span))
    }
}

/// Records the call to `dependency`, if named, in
/// `keel_client_call_duration_seconds`: `error` for a failure or an error
/// status already in the headers (a trailers-only answer).
fn record_call(
    dependency: Option<keel_core::Name>,
    answered: &Result<Response<Body>, Status>,
    seconds: f64,
) {
    let Some(dependency) = dependency else {
        return;
    };
    let failed = match answered {
        Ok(response) => response
            .headers()
            .get("grpc-status")
            .is_some_and(|code| code.as_bytes() != b"0"),
        Err(_) => true,
    };
    metrics::histogram!(
        "keel_client_call_duration_seconds",
        "dependency" => dependency.to_string(),
        "outcome" => if failed { "error" } else { "ok" },
    )
    .record(seconds);
}

/// Records the time to the response's headers in
/// `keel_grpc_client_duration_seconds` by `method` (the path the generated
/// client sends, so bounded by the proto) and `outcome`: `answered`, or the
/// status code a failure became. A status in the trailers comes after this
/// time and is not known here.
fn record_latency(method: String, answered: &Result<Response<Body>, Status>, seconds: f64) {
    let outcome = match answered {
        Ok(_) => "answered".to_owned(),
        Err(status) => format!("{:?}", status.code()),
    };
    metrics::histogram!("keel_grpc_client_duration_seconds", "method" => method, "outcome" => outcome)
        .record(seconds);
}

/// Seconds from `started` to now.
fn seconds_since(started: keel_core::clock::Instant) -> f64 {
    keel_core::clock::now()
        .saturating_duration_since(started)
        .as_secs_f64()
}

/// Writes `grpc-timeout` for the time left (or keeps a shorter one tonic
/// wrote), or refuses if no more than `min` is left.
fn send_timeout<B>(
    request: &mut Request<B>,
    deadline: Deadline,
    min: Duration,
) -> Result<(), Status> {
    let left = deadline.check_start(min).map_err(|refusal| {
        let mut status = Status::deadline_exceeded(format!(
            "{:?} left before the deadline, no more than the {min:?} a call needs: not sent",
            deadline.remaining()
        ));
        // The refusal stays findable: the call never left, so a saga or a
        // retry does not count it as an attempt.
        status.set_source(std::sync::Arc::new(refusal));
        status
    })?;
    let already = request
        .headers()
        .get(GRPC_TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| grpc_timeout::decode(v).ok());
    let send = already.map_or(left, |set| set.min(left));
    let value = HeaderValue::try_from(grpc_timeout::encode(send))
        .unwrap_or_else(|_| unreachable!("grpc_timeout::encode writes digits and a unit"));
    request.headers_mut().insert(GRPC_TIMEOUT_HEADER, value);
    Ok(())
}

/// The error as the [`Status`] it means, the error itself kept as its
/// source (so a caller can still find a [`keel_core::Rejected`] in it).
fn as_status(err: BoxError) -> Status {
    let err = match err.downcast::<Status>() {
        Ok(status) => return *status,
        Err(err) => err,
    };
    let mut status = crate::status::from_error(err.as_ref());
    status.set_source(std::sync::Arc::from(err));
    status
}

fn count(outcome: &'static str) {
    metrics::counter!("keel_grpc_client_calls_total", "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_earlier_of_the_deadline_and_tonics_timeout_is_sent() {
        let deadline = Deadline::after(Duration::from_millis(300));
        let mut request = Request::new(());
        send_timeout(&mut request, deadline, MIN_TIME_TO_START).unwrap();
        assert_eq!(request.headers()[GRPC_TIMEOUT_HEADER], "300000u");
        let mut shorter = Request::new(());
        shorter
            .headers_mut()
            .insert(GRPC_TIMEOUT_HEADER, HeaderValue::from_static("100m"));
        send_timeout(&mut shorter, deadline, MIN_TIME_TO_START).unwrap();
        assert_eq!(shorter.headers()[GRPC_TIMEOUT_HEADER], "100000u");
        let nearly = Deadline::after(Duration::from_millis(40));
        let refused = send_timeout(&mut Request::new(()), nearly, MIN_TIME_TO_START).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DeadlineExceeded);
        let refused = crate::GrpcCallError::from(refused);
        assert_eq!(
            keel_core::Classify::class(&refused),
            keel_core::ErrorClass::Rejected,
            "never sent: a refusal, not an outcome unknown"
        );
    }

    #[test]
    fn refusals_from_below_become_their_codes() {
        let open: BoxError = Box::new(keel_core::Rejected::circuit_open(
            "shipping",
            Duration::from_secs(1),
        ));
        let status = as_status(open);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(crate::status::retry_pushback(&status).is_some());
        let cause = keel_core::error::find_cause::<keel_core::Rejected>(&status);
        assert!(cause.is_some(), "the refusal stays findable");
    }

    #[tokio::test]
    async fn every_call_lands_in_the_latency_histogram_by_method_and_outcome() {
        let recorder = keel_testkit::metrics::MetricsRecorder::global();
        let call = |path: &str| {
            Request::builder()
                .uri(path)
                .body(Body::empty())
                .expect("a valid request")
        };
        let answers = tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Status>(Response::new(Body::empty()))
        });
        let mut answering = PropagationLayer::new().layer(answers);
        answering.call(call("/shop.v1.Shipping/Get")).await.unwrap();
        let refuses = tower::service_fn(|_: Request<Body>| async {
            Err::<Response<Body>, _>(Status::unavailable("down"))
        });
        let mut refusing = PropagationLayer::new().layer(refuses);
        refusing
            .call(call("/shop.v1.Shipping/Get"))
            .await
            .unwrap_err();

        let key = |outcome: &str| {
            format!(
                "keel_grpc_client_duration_seconds,method=/shop.v1.Shipping/Get,outcome={outcome}"
            )
        };
        assert_eq!(recorder.samples(&key("answered")).len(), 1);
        assert_eq!(recorder.samples(&key("Unavailable")).len(), 1);
    }

    #[tokio::test]
    async fn a_named_dependency_counts_its_calls_like_an_http_one() {
        let recorder = keel_testkit::metrics::MetricsRecorder::global();
        let call = || {
            Request::builder()
                .uri("/shop.v1.Shipping/Create")
                .body(Body::empty())
                .expect("a valid request")
        };
        let answers = tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Status>(Response::new(Body::empty()))
        });
        // A trailers-only answer: the error status is in the headers.
        let fails_in_headers = tower::service_fn(|_: Request<Body>| async {
            let mut response = Response::new(Body::empty());
            response
                .headers_mut()
                .insert("grpc-status", HeaderValue::from_static("14"));
            Ok::<_, Status>(response)
        });
        let refuses = tower::service_fn(|_: Request<Body>| async {
            Err::<Response<Body>, _>(Status::unavailable("down"))
        });
        let layer = PropagationLayer::new().dependency("shipping-test");
        layer.layer(answers).call(call()).await.unwrap();
        layer.layer(fails_in_headers).call(call()).await.unwrap();
        layer.layer(refuses).call(call()).await.unwrap_err();
        // Unnamed, nothing is counted by dependency.
        let plain = tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Status>(Response::new(Body::empty()))
        });
        PropagationLayer::new()
            .layer(plain)
            .call(call())
            .await
            .unwrap();

        let key = |outcome: &str| {
            format!("keel_client_call_duration_seconds,dependency=shipping-test,outcome={outcome}")
        };
        assert_eq!(recorder.samples(&key("ok")).len(), 1);
        assert_eq!(recorder.samples(&key("error")).len(), 2);
    }
}
