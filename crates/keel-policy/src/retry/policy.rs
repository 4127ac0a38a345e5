//! What deserves another attempt: by default an error's [`ErrorClass`];
//! optionally a predicate on the error, and one on successful results.
//!
//! The default, [`ByClass`], needs no configuration: it retries
//! [`Retryable`](ErrorClass::Retryable) errors and asks the [`Retry`](super::Retry)
//! about [`OutcomeUnknown`](ErrorClass::OutcomeUnknown) ones, which only an
//! idempotent operation may repeat. Refusals of other policies and permanent
//! errors are never retried.

use std::fmt;
use std::time::Duration;

use keel_core::{Classify, ErrorClass};

/// What to do after one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep this outcome: return it to the caller.
    Accept,
    /// Try again, no sooner than `after` if the dependency asked (`Retry-After`).
    Retry {
        /// How long the dependency asked to wait.
        after: Option<Duration>,
    },
    /// The attempt may or may not have taken effect: try again only if the
    /// policy was marked idempotent ([`RetryBuilder::retry_outcome_unknown`](super::RetryBuilder::retry_outcome_unknown)).
    RetryIfIdempotent {
        /// How long the dependency asked to wait.
        after: Option<Duration>,
    },
}

impl Verdict {
    /// The verdict for an error, from its [`Classify`] class and `Retry-After`.
    pub fn by_class<E: Classify + ?Sized>(error: &E) -> Self {
        match error.class() {
            ErrorClass::Retryable => Self::Retry {
                after: error.retry_after(),
            },
            ErrorClass::OutcomeUnknown => Self::RetryIfIdempotent {
                after: error.retry_after(),
            },
            _ => Self::Accept,
        }
    }

    /// Try again after at least `after`.
    pub fn retry_after(after: Duration) -> Self {
        Self::Retry { after: Some(after) }
    }
}

impl From<bool> for Verdict {
    /// `true` retries (no `Retry-After`), `false` accepts.
    fn from(retry: bool) -> Self {
        if retry {
            Self::Retry { after: None }
        } else {
            Self::Accept
        }
    }
}

/// Decides, after each attempt, whether it is worth another.
///
/// Implement it for full control; the builder's
/// [`retry_if`](super::RetryBuilder::retry_if) and
/// [`retry_on_result`](super::RetryBuilder::retry_on_result) cover the usual cases.
pub trait RetryPolicy<T, E> {
    /// The verdict on an attempt that failed with `error`.
    fn check_error(&self, error: &E) -> Verdict;

    /// The verdict on an attempt that succeeded with `value` (by default,
    /// accept it).
    fn check_ok(&self, value: &T) -> Verdict {
        let _ = value;
        Verdict::Accept
    }
}

/// The default policy: retries by the error's [`ErrorClass`] and honours its
/// `Retry-After`; accepts every success.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByClass;

impl<T, E: Classify> RetryPolicy<T, E> for ByClass {
    #[inline]
    fn check_error(&self, error: &E) -> Verdict {
        Verdict::by_class(error)
    }
}

/// Retries the errors a predicate picks, instead of classifying them. The
/// predicate returns a `bool` or a [`Verdict`].
#[derive(Clone)]
pub struct RetryIf<F> {
    predicate: F,
}

impl<F> RetryIf<F> {
    pub(crate) fn new(predicate: F) -> Self {
        Self { predicate }
    }
}

impl<T, E, F, V> RetryPolicy<T, E> for RetryIf<F>
where
    F: Fn(&E) -> V,
    V: Into<Verdict>,
{
    fn check_error(&self, error: &E) -> Verdict {
        (self.predicate)(error).into()
    }
}

impl<F> fmt::Debug for RetryIf<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RetryIf")
    }
}

/// Adds a predicate on successful results (retry a `503` response) to
/// another policy, which still decides about errors.
#[derive(Clone)]
pub struct RetryOnResult<P, F> {
    errors: P,
    predicate: F,
}

impl<P, F> RetryOnResult<P, F> {
    pub(crate) fn new(errors: P, predicate: F) -> Self {
        Self { errors, predicate }
    }
}

impl<T, E, P, F, V> RetryPolicy<T, E> for RetryOnResult<P, F>
where
    P: RetryPolicy<T, E>,
    F: Fn(&T) -> V,
    V: Into<Verdict>,
{
    fn check_error(&self, error: &E) -> Verdict {
        self.errors.check_error(error)
    }

    fn check_ok(&self, value: &T) -> Verdict {
        (self.predicate)(value).into()
    }
}

impl<P: fmt::Debug, F> fmt::Debug for RetryOnResult<P, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryOnResult")
            .field("errors", &self.errors)
            .finish_non_exhaustive()
    }
}
