//! The span of one gRPC call, client or server side.

/// A span with the OpenTelemetry RPC conventions' attributes:
/// `/shipping.v1.Shipping/Watch` is named `shipping.v1.Shipping/Watch`.
/// `kind` is `client` or `server`.
pub(crate) fn rpc(path: &str, kind: &'static str) -> tracing::Span {
    let name = path.trim_start_matches('/');
    let (service, method) = name.split_once('/').unwrap_or((name, ""));
    tracing::info_span!(
        "grpc",
        otel.name = %name,
        otel.kind = kind,
        trace_id = tracing::field::Empty,
        "rpc.system" = "grpc",
        "rpc.service" = %service,
        "rpc.method" = %method,
    )
}
