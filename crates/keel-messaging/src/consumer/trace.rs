//! The trace a delivery's handler runs in: its own, linked to the
//! producer's span rather than nested under it, as the messaging semantic
//! conventions ask.

use std::future::Future;

use keel_core::trace::TraceState;
use keel_core::{Deadline, TraceParent};

use crate::broker::{Message, header};
use crate::envelope::Envelope;
use tracing::Instrument as _;

/// What a delivery's handler runs in: a trace of its own, linked to the
/// producer's span, not nested under it (a consumer's retries, delays and
/// dead letters are not the producer's request taking longer), with the
/// producer's `tracestate` carried across the broker.
pub(super) struct ProducerLink {
    own: TraceParent,
    state: Option<TraceState>,
    span: tracing::Span,
}

impl ProducerLink {
    /// The delivery's `process` span, with the messaging semantic
    /// conventions' attributes and the producer's span as its link.
    pub(super) fn new(
        producer: Option<TraceParent>,
        envelope: &Envelope,
        msg: &Message,
        group: &str,
    ) -> Self {
        let state = envelope
            .trace_state()
            .or_else(|| TraceState::from_raw([msg.header(header::TRACESTATE)]));
        let link = |f: fn(&TraceParent) -> String| producer.as_ref().map(f);
        let span = tracing::info_span!(
            "process",
            otel.name = %format_args!("process {}", msg.topic),
            otel.kind = "consumer",
            otel.status_code = tracing::field::Empty,
            messaging.system = "keel",
            messaging.operation.type = "process",
            messaging.destination.name = %msg.topic,
            messaging.consumer.group.name = %group,
            messaging.message.id = %msg.id,
            trace_id = tracing::field::Empty,
            link.trace_id = link(TraceParent::trace_id_hex),
            link.span_id = link(TraceParent::parent_id_hex),
        );
        let own = keel_core::trace::span::linked(&span, producer.as_ref(), state.as_ref());
        span.record("trace_id", own.trace_id_hex().as_str());
        Self { own, state, span }
    }

    /// The delivery's span: the handler, and the settling after it, run in it.
    pub(super) fn span(&self) -> &tracing::Span {
        &self.span
    }
}

/// Runs `fut` in the delivery's own trace, with the producer's trace state,
/// under the message's deadline.
pub(super) async fn in_context<F: Future>(
    context: ProducerLink,
    deadline: Option<Deadline>,
    fut: F,
) -> F::Output {
    let traced = context
        .own
        .scope(TraceState::scope_option(context.state, fut))
        .instrument(context.span);
    match deadline {
        Some(d) => d.scope(traced).await,
        None => traced.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRODUCER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn message(headers: &[(&str, &str)]) -> Message {
        let mut msg = Message::new("m-1", "orders", "k", Vec::new());
        for (name, value) in headers {
            msg.headers.insert((*name).to_owned(), (*value).to_owned());
        }
        msg
    }

    #[tokio::test]
    async fn the_handler_runs_in_a_trace_of_its_own_with_the_producers_state() {
        let mut envelope = Envelope::new("test", "t");
        envelope.traceparent = Some(PRODUCER.to_owned());
        envelope.tracestate = Some("rojo=00f067aa0ba902b7".to_owned());
        let producer = envelope.trace_parent();
        let link = ProducerLink::new(producer, &envelope, &message(&[]), "g");
        let (trace, state) = in_context(link, None, async {
            (TraceParent::current().unwrap(), TraceState::current())
        })
        .await;
        let producer = producer.unwrap();
        assert_ne!(trace.trace_id(), producer.trace_id(), "linked, not nested");
        assert_eq!(
            trace.sampled(),
            producer.sampled(),
            "the sampling decision holds"
        );
        assert_eq!(
            state.unwrap().as_str(),
            "rojo=00f067aa0ba902b7",
            "tracestate crossed the broker"
        );
    }

    #[tokio::test]
    async fn the_headers_stand_in_for_an_envelope_without_them_and_bad_state_is_dropped() {
        let envelope = Envelope::new("test", "t");
        let msg = message(&[(header::TRACESTATE, "congo=t61rcWkgMzE")]);
        let link = ProducerLink::new(None, &envelope, &msg, "g");
        let state = in_context(link, None, async { TraceState::current() }).await;
        assert_eq!(state.unwrap().as_str(), "congo=t61rcWkgMzE");
        let bad = message(&[(header::TRACESTATE, "Not Valid")]);
        let link = ProducerLink::new(None, &envelope, &bad, "g");
        assert_eq!(
            in_context(link, None, async { TraceState::current() }).await,
            None
        );
    }
}
