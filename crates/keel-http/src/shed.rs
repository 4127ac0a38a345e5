//! Load shedding at the edge: a bounded number of requests run, a bounded
//! queue sized from a latency target waits, and the rest get `503` +
//! `Retry-After` at once, counted.
//!
//! # Why shed, and why explicitly
//!
//! An HTTP handler cannot push back on its caller the way a queue consumer
//! can: the request is already here. Letting every request in only makes
//! every request slower, until all of them time out and the work done is
//! wasted. So the edge admits what it can finish in time, and refuses the
//! rest *fast*, with a status that tells the client to come back
//! (`503 Service Unavailable` + `Retry-After`), and *counts* it
//! (`keel_http_shed_total`): silence is how overload becomes invisible.
//!
//! [`HttpLoadShedLayer`] wraps a [`keel_policy::shed::LoadShed`] policy:
//!
//! | situation | answer |
//! |---|---|
//! | a slot is free (`max_in_flight`, default 64) | the handler runs |
//! | all slots taken, room in the queue | waits for a slot, at most the latency target |
//! | the queue is full too | `503` problem + `Retry-After` (default 1 s), `reason="overloaded"` |
//! | waited longer than the latency target | `503` problem + `Retry-After`, `reason="overloaded"` |
//! | the request's deadline passed while queued | `504` problem, `reason="deadline"`; never runs |
//!
//! # Sizing the queue from a latency target
//!
//! The queue bound is *latency*, not memory: with `max_in_flight` requests
//! in parallel taking `service_time` each, a queued request waits about
//! `queued × service_time / max_in_flight`, so the policy allows
//! `latency_target × max_in_flight / service_time` queued requests
//! (defaults: 100 ms × 64 / 10 ms = 640). See
//! [`LoadShedConfig`].
//!
//! # Deadlines
//!
//! A queued request never waits past its deadline: the current
//! [`Deadline`] if a [`DeadlineLayer`](crate::propagation::DeadlineLayer)
//! runs outside this layer; otherwise, by default, the request's own
//! `X-Request-Deadline-Unix-Ms`, capped at 30 s
//! ([`deadline_header`](HttpLoadShedLayer::deadline_header)), which then also
//! becomes the handler's deadline. A malformed header is ignored here (the
//! deadline layer answers it with `400`).
//!
//! Put the layer outermost among the expensive ones, and keep health
//! probes outside it (merge their routes after applying it): a probe
//! must not be shed, nor queue behind real traffic.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use keel_http::shed::HttpLoadShedLayer;
//! use keel_policy::shed::LoadShed;
//!
//! let shed = LoadShed::builder("api")
//!     .max_in_flight(32)
//!     .latency_target(Duration::from_millis(200), Duration::from_millis(20))
//!     .build()
//!     .unwrap();
//! let app: Router = Router::new()
//!     .route("/orders", get(|| async { "ok" }))
//!     .layer(HttpLoadShedLayer::new(shed));
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::response::IntoResponse;
use keel_core::deadline::DEADLINE_HEADER;
use keel_core::{BoxError, Deadline, Name, PolicyError, Rejected};
use keel_policy::ConfigError;
use keel_policy::shed::{LoadShed, LoadShedConfig, LoadShedStats};
use tower_layer::Layer;
use tower_service::Service;

use crate::problem::Problem;
/// The response future of [`HttpLoadShedService`].
pub use crate::response_future::ResponseFuture;

/// How far away a deadline read from the header may be by default: 30 s,
/// as [`DeadlineLayer`](crate::propagation::DeadlineLayer)'s default.
pub const DEFAULT_HEADER_DEADLINE_MAX: Duration = Duration::from_secs(30);

/// Sheds requests at the edge with a [`LoadShed`] policy; see the
/// [module docs](self). Cheap to clone; clones share the policy and the
/// counts.
#[derive(Debug, Clone)]
pub struct HttpLoadShedLayer {
    shared: Arc<Shared>,
    header_max: Option<Duration>,
}

#[derive(Debug)]
struct Shared {
    shed: LoadShed,
    overloaded: AtomicU64,
    expired: AtomicU64,
    overloaded_total: metrics::Counter,
    expired_total: metrics::Counter,
}

/// What a [`HttpLoadShedLayer`] has done, and what its policy holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeShedStats {
    /// Requests answered `503` because the queue was full or the wait too
    /// long.
    pub overloaded: u64,
    /// Requests answered `504` because their deadline passed while queued.
    pub expired: u64,
    /// The policy's counts: in flight, queued, and their bounds.
    pub policy: LoadShedStats,
}

impl HttpLoadShedLayer {
    /// A layer shedding with `shed`.
    pub fn new(shed: LoadShed) -> Self {
        let name: Name = *shed.name();
        let counter = |reason: &'static str| metrics::counter!("keel_http_shed_total", "name" => name.as_str(), "reason" => reason);
        Self {
            shared: Arc::new(Shared {
                overloaded_total: counter("overloaded"),
                expired_total: counter("deadline"),
                shed,
                overloaded: AtomicU64::new(0),
                expired: AtomicU64::new(0),
            }),
            header_max: Some(DEFAULT_HEADER_DEADLINE_MAX),
        }
    }

    /// A layer with a policy named `name` built from `config`, or the
    /// setting that cannot work.
    pub fn from_config(name: impl Into<Name>, config: LoadShedConfig) -> Result<Self, ConfigError> {
        Ok(Self::new(config.build(name)?))
    }

    /// Whether, when no deadline is current, the request's
    /// `X-Request-Deadline-Unix-Ms` bounds its wait, capped at `max`
    /// (default `Some(30 s)`); `None` ignores the header.
    #[must_use]
    pub fn deadline_header(mut self, max: Option<Duration>) -> Self {
        self.header_max = max.filter(|max| !max.is_zero());
        self
    }

    /// The policy.
    pub fn policy(&self) -> &LoadShed {
        &self.shared.shed
    }

    /// What the layer has shed so far, and the policy's state now.
    pub fn stats(&self) -> EdgeShedStats {
        EdgeShedStats {
            overloaded: self.shared.overloaded.load(Ordering::Relaxed),
            expired: self.shared.expired.load(Ordering::Relaxed),
            policy: self.shared.shed.stats(),
        }
    }
}

impl<S> Layer<S> for HttpLoadShedLayer {
    type Service = HttpLoadShedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpLoadShedService {
            inner,
            shared: Arc::clone(&self.shared),
            header_max: self.header_max,
        }
    }
}

/// The service made by [`HttpLoadShedLayer`].
#[derive(Debug, Clone)]
pub struct HttpLoadShedService<S> {
    inner: S,
    shared: Arc<Shared>,
    header_max: Option<Duration>,
}

impl<S> HttpLoadShedService<S> {
    keel_core::inner_service_accessors!(inner: S);
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for HttpLoadShedService<S>
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
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        let from_header = match (Deadline::current(), self.header_max) {
            (None, Some(max)) => header_deadline(request.headers(), max),
            _ => None,
        };
        let admitted = {
            let shared = Arc::clone(&shared);
            async move { shared.shed.call(|| inner.call(request)).await }
        };
        ResponseFuture::new(async move {
            let result = match from_header {
                Some(deadline) => deadline.scope(admitted).await,
                None => admitted.await,
            };
            match result {
                Ok(response) => Ok(response.map(Body::new)),
                Err(PolicyError::Inner(err)) => Err(err),
                Err(PolicyError::Rejected(rejected)) => Ok(shared.refuse(&rejected)),
            }
        })
    }
}

impl Shared {
    fn refuse(&self, rejected: &Rejected) -> Response<Body> {
        match rejected {
            Rejected::DeadlineExceeded => {
                self.expired.fetch_add(1, Ordering::Relaxed);
                self.expired_total.increment(1);
                tracing::debug!(shed = %self.shed.name(), "deadline passed while queued: 504");
                Problem::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "the request's deadline passed while it waited for a free slot, so it was \
                     dropped without running; the service is overloaded, retry later with a \
                     later deadline",
                )
                .typed("deadline_exceeded")
                .into_response()
            }
            other => {
                self.overloaded.fetch_add(1, Ordering::Relaxed);
                self.overloaded_total.increment(1);
                tracing::debug!(shed = %self.shed.name(), "overloaded: request shed with 503");
                Problem::from_rejected(other).into_response()
            }
        }
    }
}

/// The request's own deadline, capped at `max`; `None` without a valid
/// header.
fn header_deadline(headers: &HeaderMap, max: Duration) -> Option<Deadline> {
    let value = headers.get(DEADLINE_HEADER)?.to_str().ok()?;
    Some(Deadline::parse_header(value).ok()?.capped(max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_header_deadline_is_capped_and_malformed_ones_ignored() {
        let mut headers = HeaderMap::new();
        assert!(header_deadline(&headers, Duration::from_secs(1)).is_none());
        let far = keel_core::clock::unix_millis() + 3_600_000;
        headers.insert(DEADLINE_HEADER, far.to_string().parse().unwrap());
        let d = header_deadline(&headers, Duration::from_secs(1)).unwrap();
        assert!(d.remaining() <= Duration::from_secs(1));
        headers.insert(DEADLINE_HEADER, "soon".parse().unwrap());
        assert!(header_deadline(&headers, Duration::from_secs(1)).is_none());
    }

    #[test]
    fn deadline_header_can_be_turned_off() {
        let shed = LoadShed::builder("t").build().unwrap();
        let layer = HttpLoadShedLayer::new(shed).deadline_header(None);
        assert_eq!(layer.header_max, None);
        assert!(
            HttpLoadShedLayer::from_config(
                "t",
                LoadShedConfig {
                    max_in_flight: 0,
                    ..LoadShedConfig::default()
                }
            )
            .is_err()
        );
    }
}
