//! [`TraceContextLayer`]: the caller's W3C `traceparent` metadata as the
//! trace the handler runs in.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderMap, Request};
use keel_core::TraceParent;
use keel_core::trace::{TRACEPARENT_HEADER, TRACESTATE_HEADER, TraceState};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

/// Runs each call as a span of the caller's trace: a valid `traceparent`
/// makes the handler's context a child of it; none, a malformed one or
/// several start a new trace, as the W3C specification asks of a receiver
/// (a gRPC caller cannot be told about a bad header the way an HTTP one
/// can, and its call must not fail for it).
///
/// The handler reads the context with [`TraceParent::current`]; Keel's
/// clients (HTTP and gRPC) send it on.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextLayer;

impl TraceContextLayer {
    /// The layer.
    pub fn new() -> Self {
        Self
    }
}

impl<S> Layer<S> for TraceContextLayer {
    type Service = TraceContextService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextService { inner }
    }
}

/// The service made by [`TraceContextLayer`].
#[derive(Debug, Clone)]
pub struct TraceContextService<S> {
    inner: S,
}

impl<S, ReqBody> Service<Request<ReqBody>> for TraceContextService<S>
where
    S: Service<Request<ReqBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (caller, state) = inbound(request.headers());
        let span = crate::span::rpc(request.uri().path(), "server");
        let context = keel_core::trace::span::child(&span, caller.as_ref(), state.as_ref());
        span.record("trace_id", context.trace_id_hex().as_str());
        let call = self.inner.call(request);
        Box::pin(
            context
                .scope(TraceState::scope_option(state, call))
                .instrument(span),
        )
    }
}

/// The caller's trace context and its `tracestate` (dropped whole if
/// invalid); none for a missing, malformed or repeated `traceparent`.
fn inbound(headers: &HeaderMap) -> (Option<TraceParent>, Option<TraceState>) {
    let mut values = headers.get_all(TRACEPARENT_HEADER).iter();
    let parsed = match (values.next(), values.next()) {
        (Some(value), None) => value
            .to_str()
            .ok()
            .and_then(|text| text.parse::<TraceParent>().ok()),
        _ => None,
    };
    if parsed.is_none() && headers.contains_key(TRACEPARENT_HEADER) {
        metrics::counter!("keel_grpc_server_calls_total", "outcome" => "bad_traceparent")
            .increment(1);
        tracing::debug!("malformed or repeated traceparent ignored: a new trace starts");
    }
    match parsed {
        Some(caller) => {
            let values = headers.get_all(TRACESTATE_HEADER).iter();
            let state = TraceState::from_raw(values.map(|v| v.to_str().ok()));
            (Some(caller), state)
        }
        None => (None, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALLER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_valid_caller_is_continued_and_anything_else_starts_anew() {
        let mut map = HeaderMap::new();
        map.insert(TRACEPARENT_HEADER, CALLER.parse().unwrap());
        map.insert(TRACESTATE_HEADER, "rojo=1".parse().unwrap());
        let (caller, state) = inbound(&map);
        assert_eq!(state.unwrap().as_str(), "rojo=1");
        assert_eq!(caller.unwrap().to_string(), CALLER);
        for bad in [
            "00-xyz",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            let mut map = HeaderMap::new();
            map.insert(TRACEPARENT_HEADER, bad.parse().unwrap());
            map.insert(TRACESTATE_HEADER, "rojo=1".parse().unwrap());
            let (caller, state) = inbound(&map);
            assert_eq!(state, None, "no tracestate without its traceparent");
            assert_eq!(caller, None);
        }
        let mut twice = HeaderMap::new();
        twice.append(TRACEPARENT_HEADER, CALLER.parse().unwrap());
        twice.append(TRACEPARENT_HEADER, CALLER.parse().unwrap());
        assert_eq!(inbound(&twice), (None, None));
    }
}
