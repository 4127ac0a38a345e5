//! [`TraceContextLayer`]: the inbound W3C `traceparent` as the trace the
//! handler runs in, echoed back to the caller.

use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use axum::response::IntoResponse;
use keel_core::trace::{TRACEPARENT_HEADER, TRACESTATE_HEADER, TraceState};
use keel_core::{BoxError, TraceParent};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use super::ResponseFuture;
use crate::problem::Problem;

/// The response header naming the server's span, W3C Trace Context
/// Level 2: `00-<trace id>-<server span id>-<flags>`.
pub const TRACERESPONSE_HEADER: HeaderName = HeaderName::from_static("traceresponse");

/// The response header carrying the bare trace id (32 hex digits), for
/// humans and log searches.
pub const TRACE_ID_HEADER: HeaderName = HeaderName::from_static("x-trace-id");

/// The problem type of a malformed `traceparent`.
const INVALID_TRACEPARENT: &str = "urn:keel:problem:invalid_traceparent";

/// Runs each request as a span of the caller's trace; see the
/// [module docs](super).
///
/// | request | the handler runs in | answer |
/// |---|---|---|
/// | no `traceparent` | a new trace | handler's, with `traceresponse` and `x-trace-id` |
/// | a valid `traceparent` | a child span of it | handler's, with `traceresponse` and `x-trace-id` |
/// | a malformed one, or several | — | `400` problem (default) |
/// | a malformed one, [`lenient`](Self::lenient) | a new trace | handler's |
///
/// # Why `400` for a malformed `traceparent`
///
/// The W3C specification tells a receiver to ignore an invalid
/// `traceparent` and start a new trace, so that a broken tracer upstream
/// never fails requests. Keel's rule for bad input is a `4xx` with a clear
/// message, so a client with a broken propagator finds out at once instead
/// of silently losing its traces. Services that accept traffic from
/// clients they cannot fix should use [`lenient`](Self::lenient).
///
/// The handler also runs inside a `tracing` span named `http.request` with
/// `trace_id`, `span_id`, `method` and `path`, so every log line of the
/// request carries the trace id. It is the server span of the OpenTelemetry
/// HTTP conventions (`otel.kind = "server"`, named `{method} {route}`, with
/// `http.request.method`, `http.route`, `url.path` and
/// `http.response.status_code`): with `keel-core`'s `otel` feature and a
/// `tracing-opentelemetry` layer it is exported, and the ids the handler
/// carries on are its ids. `tracestate` is not interpreted.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextLayer {
    lenient: bool,
}

impl TraceContextLayer {
    /// A layer that refuses a malformed `traceparent` with `400`.
    pub fn new() -> Self {
        Self { lenient: false }
    }

    /// Ignores a malformed `traceparent` and starts a new trace, as the W3C
    /// specification recommends.
    #[must_use]
    pub fn lenient(mut self) -> Self {
        self.lenient = true;
        self
    }
}

impl<S> Layer<S> for TraceContextLayer {
    type Service = TraceContextService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextService {
            inner,
            lenient: self.lenient,
        }
    }
}

/// The service made by [`TraceContextLayer`].
#[derive(Debug, Clone)]
pub struct TraceContextService<S> {
    inner: S,
    lenient: bool,
}

impl<S> TraceContextService<S> {
    keel_core::inner_service_accessors!(inner: S);
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for TraceContextService<S>
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
        // A tracestate only means something beside the traceparent it
        // came with (W3C): a new trace starts without one.
        let (parent, state) = match incoming(request.headers()) {
            Ok(Some(parent)) => (Some(parent), incoming_state(request.headers())),
            Ok(None) => (None, None),
            Err(detail) if self.lenient => {
                tracing::debug!(%detail, "malformed traceparent ignored: new trace started");
                (None, None)
            }
            Err(detail) => {
                metrics::counter!("keel_http_traceparent_malformed_total").increment(1);
                tracing::debug!(%detail, "malformed traceparent: 400");
                let problem = Problem::bad_request(detail).with_type(INVALID_TRACEPARENT);
                return ResponseFuture::new(async move { Ok(problem.into_response()) });
            }
        };
        let log_span = server_span(&request);
        let span = keel_core::trace::span::child(&log_span, parent.as_ref(), state.as_ref());
        let trace_id = span.trace_id_hex();
        log_span.record("trace_id", trace_id.as_str());
        log_span.record("span_id", span.parent_id_hex().as_str());
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let handler = span.scope(TraceState::scope_option(state, async move {
            inner.call(request).await
        }));
        ResponseFuture::new(
            async move {
                let mut response = handler.await?.map(Body::new);
                record_status(response.status());
                let headers = response.headers_mut();
                if let Ok(value) = HeaderValue::from_str(&span.to_string()) {
                    headers.insert(TRACERESPONSE_HEADER, value);
                }
                if let Ok(value) = HeaderValue::from_str(&trace_id) {
                    headers.insert(TRACE_ID_HEADER, value);
                }
                Ok(response)
            }
            .instrument(log_span),
        )
    }
}

/// The server span, with the OpenTelemetry HTTP semantic conventions
/// attributes; named `{method} {route}` once the router matched one.
fn server_span<B>(request: &Request<B>) -> tracing::Span {
    let method = request.method().as_str();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let name = match &route {
        Some(route) => format!("{method} {route}"),
        None => method.to_owned(),
    };
    tracing::info_span!(
        "http.request",
        otel.name = %name,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
        method = %method,
        path = %request.uri().path(),
        "http.request.method" = %method,
        "http.route" = route,
        "url.path" = %request.uri().path(),
        "http.response.status_code" = tracing::field::Empty,
    )
}

/// Records the answer on the current (server) span; a 5xx is an error,
/// a 4xx is the client's (OpenTelemetry HTTP server conventions).
fn record_status(status: axum::http::StatusCode) {
    let span = tracing::Span::current();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// The caller's `tracestate`, or none if absent or invalid (dropped whole).
fn incoming_state(headers: &HeaderMap) -> Option<TraceState> {
    let values = headers.get_all(TRACESTATE_HEADER).iter();
    TraceState::from_raw(values.map(|v| v.to_str().ok()))
}

/// The caller's trace context: none without a header; an error (the
/// problem's detail) for a malformed one or several.
fn incoming(headers: &HeaderMap) -> Result<Option<TraceParent>, String> {
    let mut values = headers.get_all(TRACEPARENT_HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(
            "several traceparent headers were sent; send exactly one (W3C Trace Context)"
                .to_owned(),
        );
    }
    let text = value
        .to_str()
        .map_err(|_| "the traceparent header is not visible ASCII".to_owned())?;
    text.parse::<TraceParent>().map(Some).map_err(|err| {
        format!("malformed traceparent header: {err}; send a valid one or none at all")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_one_valid_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(incoming(&headers), Ok(None));
        headers.insert(TRACEPARENT_HEADER, VALID.parse().unwrap());
        assert_eq!(incoming(&headers).unwrap().unwrap().to_string(), VALID);
        headers.append(TRACEPARENT_HEADER, VALID.parse().unwrap());
        assert!(incoming(&headers).unwrap_err().contains("several"));
    }

    #[test]
    fn malformed_headers_are_errors() {
        for bad in [
            "",
            "garbage",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(TRACEPARENT_HEADER, bad.parse().unwrap());
            assert!(incoming(&headers).is_err(), "{bad:?}");
        }
    }
}
