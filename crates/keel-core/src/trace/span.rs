//! Starting a span: the bridge between Keel's trace context and exported
//! OpenTelemetry spans.
//!
//! Keel carries its trace context itself ([`TraceParent::scope`]), so
//! propagation works with no tracing backend at all. A span that is
//! exported must carry the very ids Keel sends on: otherwise the trace a
//! collector shows and the `traceparent` the next hop receives disagree,
//! and the story breaks at that hop. So every place Keel starts a span
//! asks this module for the span's context instead of making ids itself.
//!
//! With the `otel` feature and a `tracing-opentelemetry` layer installed,
//! [`child`] and [`linked`] set the `tracing` span's OpenTelemetry parent (or
//! link), start it, and return its ids, sampling decision included.
//! Without either, they make ids as [`TraceParent::child`] and
//! [`TraceParent::linked_root`] do: the cost of a subscriber lookup.
//!
//! ```
//! use keel_core::TraceParent;
//! use keel_core::trace::span;
//! let caller: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap();
//! let own = span::child(&tracing::info_span!("work"), Some(&caller), None);
//! assert_eq!(own.trace_id(), caller.trace_id());
//! let consumer = span::linked(&tracing::info_span!("process"), Some(&caller), None);
//! assert_ne!(consumer.trace_id(), caller.trace_id());
//! ```

use super::{TraceParent, TraceState};

/// Starts `span` as a child of `parent` (a new trace without one) and
/// returns the context to carry on: the span's own ids.
pub fn child(
    span: &tracing::Span,
    parent: Option<&TraceParent>,
    state: Option<&TraceState>,
) -> TraceParent {
    bridge::child(span, parent, state)
        .unwrap_or_else(|| parent.map_or_else(TraceParent::new_root, TraceParent::child))
}

/// Starts `span` as a call out of the running task's trace (a new trace
/// outside one) and returns what goes on the wire: the span's context, and
/// the task's `tracestate`, which travels with it unchanged. Every client
/// edge (HTTP, gRPC) sends these two.
pub fn outgoing(span: &tracing::Span) -> (TraceParent, Option<TraceState>) {
    let state = TraceState::current();
    let context = child(span, TraceParent::current().as_ref(), state.as_ref());
    (context, state)
}

/// Starts `span` as the root of a new trace linked to `producer`: the
/// consumer of a message, which is caused by the producer but not part of
/// its work (see [`TraceParent::linked_root`]).
pub fn linked(
    span: &tracing::Span,
    producer: Option<&TraceParent>,
    state: Option<&TraceState>,
) -> TraceParent {
    bridge::linked(span, producer, state)
        .unwrap_or_else(|| producer.map_or_else(TraceParent::new_root, TraceParent::linked_root))
}

/// Links `span`, not yet started, to `to`: the relay's batch span links
/// each message it sends, as the messaging conventions ask of a batch.
pub fn link(span: &tracing::Span, to: &TraceParent, state: Option<&TraceState>) {
    bridge::link(span, to, state);
}

#[cfg(feature = "otel")]
mod bridge {
    use super::{TraceParent, TraceState};
    use opentelemetry::Context;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState as OtelState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    pub(super) fn child(
        span: &tracing::Span,
        parent: Option<&TraceParent>,
        state: Option<&TraceState>,
    ) -> Option<TraceParent> {
        let cx = match parent {
            Some(parent) => Context::new().with_remote_span_context(remote(parent, state)),
            None => Context::new(),
        };
        span.set_parent(cx).ok()?;
        started(span)
    }

    pub(super) fn linked(
        span: &tracing::Span,
        producer: Option<&TraceParent>,
        state: Option<&TraceState>,
    ) -> Option<TraceParent> {
        span.set_parent(Context::new()).ok()?;
        if let Some(producer) = producer {
            link(span, producer, state);
        }
        started(span)
    }

    pub(super) fn link(span: &tracing::Span, to: &TraceParent, state: Option<&TraceState>) {
        span.add_link(remote(to, state));
    }

    fn remote(parent: &TraceParent, state: Option<&TraceState>) -> SpanContext {
        let state = state
            .and_then(|s| s.as_str().parse::<OtelState>().ok())
            .unwrap_or_default();
        SpanContext::new(
            TraceId::from_bytes(parent.trace_id()),
            SpanId::from_bytes(parent.parent_id()),
            TraceFlags::new(parent.flags()),
            true,
            state,
        )
    }

    fn started(span: &tracing::Span) -> Option<TraceParent> {
        let cx = span.context();
        let own = cx.span().span_context().clone();
        own.is_valid().then(|| {
            TraceParent::new(
                own.trace_id().to_bytes(),
                own.span_id().to_bytes(),
                own.is_sampled(),
            )
        })
    }
}

#[cfg(not(feature = "otel"))]
mod bridge {
    use super::{TraceParent, TraceState};

    pub(super) fn child(
        _: &tracing::Span,
        _: Option<&TraceParent>,
        _: Option<&TraceState>,
    ) -> Option<TraceParent> {
        None
    }

    pub(super) fn linked(
        _: &tracing::Span,
        _: Option<&TraceParent>,
        _: Option<&TraceState>,
    ) -> Option<TraceParent> {
        None
    }

    pub(super) fn link(_: &tracing::Span, _: &TraceParent, _: Option<&TraceState>) {}
}
