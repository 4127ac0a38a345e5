//! One saga call: its span, its timeout and key, its crash points, and
//! the record its outcome leads to.

use keel_core::error::{classify, find_cause, report};
use keel_core::{Deadline, Rejected, TraceParent};
use tracing::Instrument;

use super::SagaOrchestrator;
use crate::saga::SagaError;
use crate::saga::definition::ErasedSaga;
use crate::saga::machine::{self, Call, Claim, Outcome};
use crate::store::{SagaRecord, SagaStore};

impl<S: SagaStore> SagaOrchestrator<S> {
    /// Makes `claim`'s call; returns the record it leads to, not saved yet.
    pub(super) async fn call(
        &self,
        saga: &dyn ErasedSaga,
        claim: &Claim,
    ) -> Result<SagaRecord, SagaError> {
        let call = claim.call;
        crash_point("keel-saga-after-claim", &claim.record.id)?;
        let outcome = self.execute(saga, call, &claim.record).await;
        crash_point(
            match call {
                Call::Action(_) => "keel-saga-after-step",
                Call::Compensation(_) => "keel-saga-after-compensation",
            },
            &claim.record.id,
        )?;
        let now = keel_core::clock::utc_now();
        Ok(machine::decide(claim, saga.shape(), outcome, now))
    }

    /// Makes one call with its timeout and idempotency key.
    async fn execute(&self, saga: &dyn ErasedSaga, call: Call, record: &SagaRecord) -> Outcome {
        let shape = saga.shape();
        let step = shape.step(call);
        let key = call.idempotency_key(&record.id, shape);
        let timeout = machine::call_timeout(record, shape, call, keel_core::clock::utc_now());
        let labels = [
            ("saga", saga.name().to_owned()),
            ("step", step.name.to_string()),
            ("call", call.kind().to_owned()),
        ];
        // A first attempt is routine, one per step of every saga: at INFO it
        // was most of a busy server's log lines. A repeat follows a failure
        // or a restart, which an operator wants to see.
        if record.attempts > 1 {
            tracing::info!(step = %step.name, call = call.kind(), attempt = record.attempts, %key, "saga call repeated");
        } else {
            tracing::debug!(step = %step.name, call = call.kind(), %key, "saga call");
        }
        let started = keel_core::clock::now();
        let (span, context) = step_span(saga.name(), &step.name, call, record);
        let fut = context.scope(Deadline::after(timeout).scope(saga.call(call, record, key)));
        let fut = tokio::time::timeout(timeout, fut).instrument(span.clone());
        let (outcome, label) = match fut.await {
            Ok(Ok(data)) => (Outcome::Done(data), "ok"),
            Ok(Err(e)) => {
                let class = classify(e.as_ref());
                let label = if class == keel_core::ErrorClass::Rejected {
                    "refused"
                } else {
                    "error"
                };
                let failed = Outcome::Failed {
                    class,
                    error: report(e.as_ref()),
                    retry_after: find_cause::<Rejected>(e.as_ref()).and_then(Rejected::retry_after),
                };
                (failed, label)
            }
            Err(_) => (
                Outcome::Failed {
                    class: keel_core::ErrorClass::OutcomeUnknown,
                    error: format!("timed out after {timeout:?}"),
                    retry_after: None,
                },
                "timeout",
            ),
        };
        metrics::histogram!("keel_saga_call_duration_seconds", &labels)
            .record(started.elapsed().as_secs_f64());
        let mut labels = labels.to_vec();
        labels.push(("outcome", label.to_owned()));
        metrics::counter!("keel_saga_calls_total", &labels).increment(1);
        span.record("keel.saga.outcome", label);
        if let Outcome::Failed { error, class, .. } = &outcome {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", tracing::field::debug(class));
            tracing::warn!(step = %step.name, call = call.kind(), ?class, %error, "saga call failed");
        }
        outcome
    }
}

/// A place where a test can make the orchestrator "crash" (stop without
/// saving), with the `failpoints` feature: configure the failpoint with
/// `return` (every saga) or `return(<saga id>)` (only that saga).
#[cfg(feature = "failpoints")]
fn crash_point(name: &'static str, saga_id: &str) -> Result<(), SagaError> {
    let hit = fail::eval(name, |arg| arg.is_none_or(|id| id == saga_id));
    if hit == Some(true) {
        tracing::warn!(saga_id, failpoint = name, "failpoint: simulated crash");
        return Err(SagaError::Crashed(name));
    }
    Ok(())
}

#[cfg(not(feature = "failpoints"))]
#[inline]
fn crash_point(_name: &'static str, _saga_id: &str) -> Result<(), SagaError> {
    Ok(())
}

/// The span of one saga call, a child of the trace the saga was started
/// in; the call runs in it, so its own calls (HTTP, gRPC) nest under it.
fn step_span(
    saga: &str,
    step: &str,
    call: Call,
    record: &SagaRecord,
) -> (tracing::Span, TraceParent) {
    let span = tracing::info_span!(
        "saga.step",
        otel.name = %format_args!("{saga} {step}"),
        otel.kind = "internal",
        otel.status_code = tracing::field::Empty,
        "keel.saga.name" = saga,
        "keel.saga.id" = %record.id,
        "keel.saga.step" = step,
        "keel.saga.call" = call.kind(),
        "keel.saga.attempt" = i64::from(record.attempts),
        "keel.saga.outcome" = tracing::field::Empty,
        "error.type" = tracing::field::Empty,
    );
    let started_in = record.traceparent.as_deref().and_then(|t| t.parse().ok());
    let context = keel_core::trace::span::child(&span, started_in.as_ref(), None);
    (span, context)
}
