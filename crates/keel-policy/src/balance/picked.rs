//! The guard a pick returns: one request in flight to one endpoint.

use std::fmt;
use std::sync::Arc;

use keel_core::clock::{self, Instant};
use keel_core::{Classify, ErrorClass};

use super::Balancer;
use super::slot::Slot;

/// A request in flight to the endpoint the balancer chose.
///
/// While it lives, the endpoint's in-flight count includes it. Finish it
/// with [`success`](Self::success), [`failure`](Self::failure) or
/// [`record`](Self::record); dropping it unfinished counts as a cancelled
/// request: its latency may raise the endpoint's estimate (a caller that gave
/// up after 5 s learned something), but it is not a failure of the endpoint.
#[must_use = "a pick counts as in flight until it is finished or dropped"]
pub struct Picked<E> {
    balancer: Balancer<E>,
    slot: Arc<Slot<E>>,
    started: Instant,
    finished: bool,
}

/// How a request ended, as far as the balancer is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The endpoint answered (including with a permanent error such as 404).
    Answered,
    /// The endpoint failed in a way that counts against its health.
    Failed,
    /// The caller gave up before an answer.
    Cancelled,
    /// The request never reached the endpoint.
    NotSent,
}

impl Outcome {
    fn of(class: ErrorClass) -> Self {
        match class {
            ErrorClass::Rejected => Self::NotSent,
            class if class.is_dependency_failure() => Self::Failed,
            _ => Self::Answered,
        }
    }
}

impl<E> Picked<E> {
    pub(crate) fn new(balancer: Balancer<E>, slot: Arc<Slot<E>>, started: Instant) -> Self {
        slot.start();
        Self {
            balancer,
            slot,
            started,
            finished: false,
        }
    }

    /// The chosen endpoint.
    pub fn endpoint(&self) -> &E {
        &self.slot.endpoint
    }

    pub(crate) fn position(&self) -> usize {
        self.slot.position
    }

    /// The endpoint answered: its latency is recorded and its consecutive
    /// failures are forgiven.
    pub fn success(mut self) {
        self.finish(Outcome::Answered);
    }

    /// The request failed with an error of `class`. Retryable and
    /// outcome-unknown failures (refused connections, 503s, timeouts) count
    /// towards ejection; a permanent error is an answer (a 404 is not the
    /// endpoint's fault); a refusal means the request was never sent.
    pub fn failure(mut self, class: ErrorClass) {
        self.finish(Outcome::of(class));
    }

    /// Records a call's result: [`success`](Self::success) or
    /// [`failure`](Self::failure) by the error's class.
    pub fn record<T, X: Classify>(self, result: &Result<T, X>) {
        match result {
            Ok(_) => self.success(),
            Err(err) => self.failure(err.class()),
        }
    }

    /// Releases the pick without recording anything: the request was never
    /// sent.
    pub fn release(mut self) {
        self.finish(Outcome::NotSent);
    }

    fn finish(&mut self, outcome: Outcome) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.slot.finish();
        let now = clock::now();
        self.balancer.observe(
            &self.slot,
            outcome,
            now.saturating_duration_since(self.started),
            now,
        );
    }
}

impl<E> Drop for Picked<E> {
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}

impl<E: fmt::Debug> fmt::Debug for Picked<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Picked")
            .field("endpoint", &self.slot.endpoint)
            .field("started", &self.started)
            .finish_non_exhaustive()
    }
}
