//! Rate, errors and duration per route: the RED metrics of the edge.
//!
//! A global error rate hides the route that is failing: one endpoint at
//! 100% errors among ten healthy ones is a 9% blip. So every request is
//! counted under the route *template* that matched it (`/orders/{id}`,
//! never `/orders/A-4471`: a label per order id would grow the metrics
//! without bound), its method and its status class:
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `keel_http_requests_total` | counter | `method`, `route`, `status` (`2xx` … `5xx`, or `dropped`) |
//! | `keel_http_request_duration_seconds` | histogram | the same |
//! | `keel_http_requests_in_flight` | gauge | `method`, `route` |
//!
//! A request that matched no route is counted under `route="unmatched"`,
//! and a method outside the standard ones under `method="other"`, so a
//! scanner cannot mint series either. A request whose caller went away
//! before the answer (the future was dropped) is `status="dropped"`: it is
//! neither a success nor the server's error, and hiding it would hide
//! impatient clients and timeouts upstream. Duration runs until the
//! response head is ready; a streaming body (SSE, a long download) is not
//! timed to its end.
//!
//! Apply it with [`Router::layer`](axum::Router::layer) *after* the routes
//! are added, so it sees the matched route:
//!
//! ```
//! use axum::{Router, routing::get};
//! use keel_http::request_metrics::RequestMetricsLayer;
//!
//! let app: Router = Router::new()
//!     .route("/orders/{id}", get(|| async { "ok" }))
//!     .layer(RequestMetricsLayer::new());
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::MatchedPath;
use axum::http::{Method, Request, Response};
use keel_core::clock;
use tower_layer::Layer;
use tower_service::Service;

/// The `route` label of a request no route matched.
pub const UNMATCHED: &str = "unmatched";

/// Counts and times every request by route, method and status class; see
/// the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestMetricsLayer;

impl RequestMetricsLayer {
    /// The layer.
    pub fn new() -> Self {
        Self
    }
}

impl<S> Layer<S> for RequestMetricsLayer {
    type Service = RequestMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestMetricsService { inner }
    }
}

/// The service [`RequestMetricsLayer`] makes.
#[derive(Debug, Clone)]
pub struct RequestMetricsService<S> {
    inner: S,
}

impl<S, B, ResB> Service<Request<B>> for RequestMetricsService<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Future: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResB>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let mut record = Record::start(&request);
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            match &result {
                Ok(response) => record.finish(status_class(response.status().as_u16())),
                // An error escaping an axum router is a broken connection.
                Err(_) => record.finish("5xx"),
            }
            result
        })
    }
}

/// One request's labels and start; counts `dropped` if never finished.
struct Record {
    method: &'static str,
    route: String,
    started: tokio::time::Instant,
    finished: bool,
}

impl Record {
    fn start<B>(request: &Request<B>) -> Self {
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map_or(UNMATCHED, MatchedPath::as_str)
            .to_owned();
        let method = method_label(request.method());
        metrics::gauge!("keel_http_requests_in_flight", "method" => method, "route" => route.clone())
            .increment(1.0);
        Self {
            method,
            route,
            started: clock::now(),
            finished: false,
        }
    }

    fn finish(&mut self, status: &'static str) {
        self.finished = true;
        let (method, route) = (self.method, self.route.clone());
        metrics::counter!("keel_http_requests_total", "method" => method, "route" => route.clone(), "status" => status)
            .increment(1);
        metrics::histogram!("keel_http_request_duration_seconds", "method" => method, "route" => route, "status" => status)
            .record(clock::now().saturating_duration_since(self.started));
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        if !self.finished {
            self.finish("dropped");
        }
        metrics::gauge!("keel_http_requests_in_flight", "method" => self.method, "route" => self.route.clone())
            .decrement(1.0);
    }
}

fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
