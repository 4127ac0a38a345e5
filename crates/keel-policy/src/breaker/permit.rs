//! Permission to make one call, and what its outcome was.

use std::sync::Arc;

use keel_core::{Classify, ErrorClass};

use super::machine::{Inner, Ticket};

/// What a call's result says about the dependency's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The dependency answered (including with a permanent error such as
    /// "not found": that is the caller's problem, not the dependency's).
    Success,
    /// The dependency failed (a retryable error, one whose outcome is
    /// unknown, such as a timeout, or one nobody classified).
    Failure,
    /// The result says nothing about the dependency (an inner policy refused
    /// the call before it reached it): not recorded.
    Ignored,
}

impl Outcome {
    /// The outcome of an error of class `class`: a failure if it is a
    /// [dependency failure](ErrorClass::is_dependency_failure) (retryable,
    /// of unknown outcome, or unclassified), not recorded if it is a
    /// refusal, a success if it is permanent (the caller's own fault).
    pub fn from_class(class: ErrorClass) -> Self {
        if class.is_dependency_failure() {
            Self::Failure
        } else if class == ErrorClass::Rejected {
            Self::Ignored
        } else {
            Self::Success
        }
    }

    /// The outcome of a call's result.
    pub fn of<T, E: Classify>(result: &Result<T, E>) -> Self {
        match result {
            Ok(_) => Self::Success,
            Err(err) => Self::from_class(err.class()),
        }
    }
}

/// Permission to make one call through a breaker, from
/// [`try_acquire`](super::CircuitBreaker::try_acquire).
///
/// Report how the call went with [`record`](Self::record). A permit dropped
/// without a record counts as nothing, and a half-open probe slot it held is
/// given back, so a cancelled probe cannot leave the breaker half-open forever.
#[derive(Debug)]
#[must_use = "a permit records nothing unless `record` is called"]
pub struct Permit<'a> {
    inner: &'a Inner,
    ticket: Option<Ticket>,
    started: u64,
}

impl<'a> Permit<'a> {
    #[inline]
    pub(super) fn new(inner: &'a Inner, ticket: Ticket) -> Self {
        let started = inner.started();
        Self {
            inner,
            ticket: Some(ticket),
            started,
        }
    }

    /// Whether this call is one of the half-open probes.
    pub fn is_probe(&self) -> bool {
        self.ticket.is_some_and(|t| t.is_probe())
    }

    /// Records how the call went.
    #[inline(always)]
    pub fn record(mut self, outcome: Outcome) {
        self.settle(outcome);
    }

    /// Records a call's result, classified with [`Outcome::of`].
    pub fn record_result<T, E: Classify>(self, result: &Result<T, E>) {
        self.record(Outcome::of(result));
    }

    /// Records through `&mut self`: a permit kept across an `.await` then
    /// moved out whole costs a store-forwarding stall; fields read in place
    /// do not.
    #[inline(always)]
    pub(super) fn settle(&mut self, outcome: Outcome) {
        if let Some(ticket) = self.ticket.take() {
            self.inner.complete(ticket, self.started, outcome);
        }
    }
}

impl Drop for Permit<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.inner.abandon(ticket);
        }
    }
}

/// A [`Permit`] that owns a handle to its breaker, for calls that outlive
/// the borrow (spawned tasks, tower response futures).
#[derive(Debug)]
#[must_use = "a permit records nothing unless `record` is called"]
pub struct OwnedPermit {
    inner: Arc<Inner>,
    ticket: Option<Ticket>,
    started: u64,
}

impl OwnedPermit {
    #[inline]
    pub(super) fn new(inner: Arc<Inner>, ticket: Ticket) -> Self {
        let started = inner.started();
        Self {
            inner,
            ticket: Some(ticket),
            started,
        }
    }

    /// Whether this call is one of the half-open probes.
    pub fn is_probe(&self) -> bool {
        self.ticket.is_some_and(|t| t.is_probe())
    }

    /// Records how the call went.
    #[inline(always)]
    pub fn record(mut self, outcome: Outcome) {
        if let Some(ticket) = self.ticket.take() {
            self.inner.complete(ticket, self.started, outcome);
        }
    }

    /// Records a call's result, classified with [`Outcome::of`].
    pub fn record_result<T, E: Classify>(self, result: &Result<T, E>) {
        self.record(Outcome::of(result));
    }
}

impl Drop for OwnedPermit {
    #[inline]
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.inner.abandon(ticket);
        }
    }
}
