//! What went wrong, and what to do about it.
//!
//! Every resilience decision starts by asking what kind of failure an error
//! is. A retry must only repeat what can succeed next time; a breaker must
//! count the dependency's failures, not its own refusals; an edge must turn a
//! refusal into `503` + `Retry-After` rather than `500`. [`ErrorClass`] is
//! that answer, [`Classify`] is how a type gives it, and [`classify`] finds it
//! in any error by walking its chain of causes.
//!
//! An error nobody classified is [`ErrorClass::Unclassified`]: it counts as
//! a failure for breakers (what is not known to be the caller's fault is held
//! against the dependency, as Resilience4j and Polly count every exception),
//! and it is not retried (what is not known to be safe is not repeated).
//! [`ErrorClass::Permanent`] is only for what someone marked as the caller's
//! own fault: a 4xx, a validation error, a missing row.
//!
//! A policy that refuses or stops a call says why with [`Rejected`]; a policy's
//! result is a [`PolicyError`]: either the operation's own error, untouched, or
//! a refusal.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::clock::{self, Instant};

/// A type-erased error, as tower middleware passes them around.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

pub use crate::name::Name;

/// What kind of failure an error is. This decides whether a call is retried,
/// whether a breaker counts it, and how an edge reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorClass {
    /// A transient failure that never took effect: trying again may succeed
    /// (connection refused, 503, a dependency's `Retry-After`).
    Retryable,
    /// The caller's own fault, as its producer said: trying again will fail
    /// the same way, and the dependency is healthy (bad input, a 4xx, not
    /// found). Not retried, not held against the dependency.
    Permanent,
    /// A resilience policy refused to run the call (circuit open, bulkhead
    /// full, rate limited, deadline too close). The dependency was not called.
    Rejected,
    /// The call may or may not have taken effect (a timeout after the request
    /// was sent, a connection reset mid-response). Only retry idempotent calls.
    OutcomeUnknown,
    /// Nobody said what this error is: [`classify`] found no [`Classified`],
    /// [`Rejected`] or recognised [`std::io::Error`] among its causes. It is
    /// not retried (it is not known to be safe), and it counts against the
    /// dependency's health (it is not known to be the caller's fault): a
    /// breaker in front of a dependency that fails in a way nobody foresaw
    /// must still open. Wrap the error in [`Classified`] to say better.
    Unclassified,
}

impl ErrorClass {
    /// Whether a failure of this class should count against a dependency's
    /// health (breakers, outlier detection): retryable, of unknown outcome,
    /// or unclassified. Refusals and permanent errors are the caller's
    /// business, not the dependency's.
    pub fn is_dependency_failure(self) -> bool {
        matches!(
            self,
            Self::Retryable | Self::OutcomeUnknown | Self::Unclassified
        )
    }
}

/// A type that knows which [`ErrorClass`] it belongs to.
pub trait Classify {
    /// The class of this error.
    fn class(&self) -> ErrorClass;

    /// When the failing side asked to be tried again (a `Retry-After`), if
    /// it did. Retries honour it within their bounds.
    fn retry_after(&self) -> Option<Duration> {
        None
    }
}

impl Classify for std::io::Error {
    fn class(&self) -> ErrorClass {
        classify(self)
    }
}

impl Classify for BoxError {
    fn class(&self) -> ErrorClass {
        classify(self.as_ref())
    }

    fn retry_after(&self) -> Option<Duration> {
        retry_after(self.as_ref())
    }
}

impl Classify for std::convert::Infallible {
    fn class(&self) -> ErrorClass {
        match *self {}
    }
}

/// The class of an I/O error's kind, if the kind says it. `Other` and kinds
/// not listed say nothing: [`classify`] then looks at the error it wraps.
fn classify_io(err: &std::io::Error) -> Option<ErrorClass> {
    use std::io::ErrorKind::*;
    match err.kind() {
        // The request never reached the other side.
        ConnectionRefused | AddrNotAvailable | NotConnected | HostUnreachable
        | NetworkUnreachable | Interrupted | WouldBlock => Some(ErrorClass::Retryable),
        // The request may have been processed before the connection failed.
        ConnectionReset | ConnectionAborted | BrokenPipe | TimedOut | UnexpectedEof => {
            Some(ErrorClass::OutcomeUnknown)
        }
        // The caller asked for something that does not exist, is not allowed
        // or is malformed: asking again gets the same answer.
        NotFound | PermissionDenied | AlreadyExists | InvalidInput | InvalidData | Unsupported => {
            Some(ErrorClass::Permanent)
        }
        _ => None,
    }
}

/// The class of any error, found by walking its causes: the first cause that
/// is a [`Rejected`], a [`Classified`] or an [`std::io::Error`] of a known
/// kind decides (an I/O error of kind `Other` is looked through, to the error
/// it wraps).
///
/// An error nobody classified is [`ErrorClass::Unclassified`]: not retried,
/// because it is not known to be safe, and counted as a failure by breakers,
/// because it is not known to be the caller's fault. Wrap such errors in
/// [`Classified`] to say otherwise (`Classified::permanent` for the caller's
/// own mistakes).
///
/// ```
/// use keel_core::{error::classify, Classified, ErrorClass};
/// let err = Classified::retryable(std::fmt::Error);
/// assert_eq!(classify(&err), ErrorClass::Retryable);
/// let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// assert_eq!(classify(&io), ErrorClass::Retryable);
/// assert_eq!(classify(&std::fmt::Error), ErrorClass::Unclassified);
/// ```
pub fn classify(err: &(dyn StdError + 'static)) -> ErrorClass {
    for cause in causes(err) {
        if let Some(r) = cause.downcast_ref::<Rejected>() {
            return r.class();
        }
        if let Some(c) = cause.downcast_ref::<Classified>() {
            return c.class;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if let Some(class) = classify_io(io) {
                return class;
            }
            // `io::Error::other(e)` hides `e` from `source()` (which skips to
            // `e`'s own source): look at it directly.
            if let Some(inner) = io.get_ref() {
                return classify(inner);
            }
        }
    }
    ErrorClass::Unclassified
}

/// When the failing side asked to be tried again, found by walking the
/// error's causes: the first [`Rejected`] or [`Classified`] that carries a
/// `Retry-After`.
pub fn retry_after(err: &(dyn StdError + 'static)) -> Option<Duration> {
    causes(err).find_map(|cause| {
        if let Some(r) = cause.downcast_ref::<Rejected>() {
            return r.retry_after();
        }
        cause.downcast_ref::<Classified>()?.retry_after
    })
}

/// Iterates over an error and its chain of [`source`](StdError::source)s,
/// outermost first.
pub fn causes<'a>(err: &'a (dyn StdError + 'static)) -> Causes<'a> {
    Causes { next: Some(err) }
}

/// The iterator returned by [`causes`].
#[derive(Debug, Clone)]
pub struct Causes<'a> {
    next: Option<&'a (dyn StdError + 'static)>,
}

impl<'a> Iterator for Causes<'a> {
    type Item = &'a (dyn StdError + 'static);

    fn next(&mut self) -> Option<Self::Item> {
        let current = self.next?;
        self.next = current.source();
        Some(current)
    }
}

/// The first cause of `err` (itself included) of type `T`.
///
/// ```
/// use keel_core::{error::find_cause, Rejected};
/// let err: keel_core::BoxError = Box::new(Rejected::DeadlineExceeded);
/// assert!(find_cause::<Rejected>(err.as_ref()).is_some());
/// ```
pub fn find_cause<'a, T: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    causes(err).find_map(|e| e.downcast_ref::<T>())
}

/// Formats an error with all its causes, `outer: inner: root`, for logs and
/// problem bodies. A wrapper that shows its cause's text and also returns
/// it as its source ([`Classified`] does, so the cause stays findable) is
/// printed once, not twice.
pub fn report(err: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in causes(err) {
        let text = cause.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// An error wrapped with the class its producer knows it has.
///
/// Use it where an error type carries no classification of its own, so that
/// retries and breakers treat it correctly.
#[derive(Debug)]
pub struct Classified {
    class: ErrorClass,
    retry_after: Option<Duration>,
    source: BoxError,
}

impl Classified {
    /// Wraps `source` with an explicit class.
    pub fn new(class: ErrorClass, source: impl Into<BoxError>) -> Self {
        Self {
            class,
            retry_after: None,
            source: source.into(),
        }
    }

    /// Says when the failing side asked to be tried again (an HTTP
    /// `Retry-After`, gRPC's `grpc-retry-pushback-ms`); retries wait at
    /// least this long.
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// A transient failure that is safe to retry.
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self::new(ErrorClass::Retryable, source)
    }

    /// A failure that will not go away by retrying.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self::new(ErrorClass::Permanent, source)
    }

    /// A failure after which the call may or may not have taken effect.
    pub fn outcome_unknown(source: impl Into<BoxError>) -> Self {
        Self::new(ErrorClass::OutcomeUnknown, source)
    }

    /// The wrapped error.
    pub fn into_inner(self) -> BoxError {
        self.source
    }
}

impl Classify for Classified {
    fn class(&self) -> ErrorClass {
        self.class
    }

    fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl fmt::Display for Classified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for Classified {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.source.as_ref())
    }
}

/// Why a resilience policy refused to run a call, or stopped it.
///
/// Each variant is a marker for one policy's decision. The HTTP edge maps them
/// to `503`/`429`/`504` with `Retry-After` in one place, and
/// [`retry_after`](Rejected::retry_after) says when trying again makes sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejected {
    /// The circuit breaker for a dependency is open.
    ///
    /// It carries the instant a probe will be let through rather than the
    /// wait, so that an open breaker refuses without reading the clock: the
    /// clock is read by whoever asks for [`retry_after`](Rejected::retry_after)
    /// (the edge writing `Retry-After`), and the wait it gets is as of then.
    #[error(
        "circuit breaker `{name}` is open: `{name}` failed too often, so calls are refused \
         for {:?} more to let it recover; serve a fallback or try later",
        remaining(*.retry_at)
    )]
    CircuitOpen {
        /// The breaker's name (usually the dependency's).
        name: Name,
        /// When the breaker lets a probe through (tokio's clock).
        retry_at: Instant,
    },
    /// A retry budget is empty: the dependency is failing widely, and more
    /// retries would only multiply its load.
    #[error(
        "retry budget `{name}` is exhausted: too many calls to `{name}` are being retried, \
         so retries stop until successful traffic refills the budget"
    )]
    BudgetExhausted {
        /// The budget's name.
        name: Name,
    },
    /// A bulkhead has no free slot and its wait queue is full, or the wait
    /// took longer than allowed.
    #[error("bulkhead `{name}` is full: too many concurrent calls; try again later")]
    BulkheadFull {
        /// The bulkhead's name.
        name: Name,
    },
    /// A rate limit was reached.
    #[error("rate limit `{name}` reached: try again in {retry_after:?}")]
    RateLimited {
        /// The limiter's name.
        name: Name,
        /// How long until a call would be allowed.
        retry_after: Duration,
    },
    /// Load was shed: a bounded queue or a concurrency limit is full.
    #[error("`{name}` is overloaded and shed this call: try again in {retry_after:?}")]
    Overloaded {
        /// The shedding policy's name.
        name: Name,
        /// When trying again is reasonable.
        retry_after: Duration,
    },
    /// The request's deadline has passed, or too little time is left to start.
    #[error("deadline exceeded: too little time is left to start this call")]
    DeadlineExceeded,
    /// A call took longer than its timeout and was cancelled.
    #[error(
        "`{name}` timed out after {after:?}: the call was cancelled; it may or may not have taken effect"
    )]
    Timeout {
        /// The timeout policy's name.
        name: Name,
        /// The time limit that was reached.
        after: Duration,
    },
    /// A fault injected on purpose by a chaos policy.
    #[error("fault injected by `{name}` (chaos testing)")]
    InjectedFault {
        /// The fault injector's name.
        name: Name,
    },
    /// A load balancer had no endpoint to send the call to.
    #[error("no endpoint of `{name}` is available")]
    NoEndpoint {
        /// The balancer's name.
        name: Name,
    },
}

impl Rejected {
    /// A refusal by the open breaker `name` that lets a probe through
    /// `retry_after` from now (for breakers of your own, and for refusals
    /// read back from another service's `Retry-After`).
    pub fn circuit_open(name: impl Into<Name>, retry_after: Duration) -> Self {
        Self::CircuitOpen {
            name: name.into(),
            retry_at: clock::now() + retry_after,
        }
    }

    /// When trying again makes sense, if the policy knows (`Retry-After`).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::CircuitOpen { retry_at, .. } => Some(remaining(*retry_at)),
            Self::RateLimited { retry_after, .. } | Self::Overloaded { retry_after, .. } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }

    /// A short stable name for metrics labels and problem types.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::CircuitOpen { .. } => "circuit_open",
            Self::BudgetExhausted { .. } => "budget_exhausted",
            Self::BulkheadFull { .. } => "bulkhead_full",
            Self::RateLimited { .. } => "rate_limited",
            Self::Overloaded { .. } => "overloaded",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Timeout { .. } => "timeout",
            Self::InjectedFault { .. } => "injected_fault",
            Self::NoEndpoint { .. } => "no_endpoint",
        }
    }
}

/// The wait until `at`, as of now (zero once it has passed).
fn remaining(at: Instant) -> Duration {
    at.saturating_duration_since(clock::now())
}

impl Classify for Rejected {
    fn retry_after(&self) -> Option<Duration> {
        Rejected::retry_after(self)
    }

    fn class(&self) -> ErrorClass {
        match self {
            // The attempt was sent and cut off: it may have happened.
            Self::Timeout { .. } => ErrorClass::OutcomeUnknown,
            // An injected fault stands in for a dependency failure.
            Self::InjectedFault { .. } => ErrorClass::Retryable,
            _ => ErrorClass::Rejected,
        }
    }
}

/// The result error of a call made through a Keel policy: the operation's own
/// error, untouched, or a policy's refusal.
#[derive(Debug)]
pub enum PolicyError<E> {
    /// The operation ran and failed with its own error.
    Inner(E),
    /// A policy refused to run the operation, or stopped it.
    Rejected(Rejected),
}

impl<E> PolicyError<E> {
    /// The operation's own error, if that is what this is.
    pub fn inner(&self) -> Option<&E> {
        match self {
            Self::Inner(e) => Some(e),
            Self::Rejected(_) => None,
        }
    }

    /// Converts into the operation's own error, if that is what this is.
    pub fn into_inner(self) -> Option<E> {
        match self {
            Self::Inner(e) => Some(e),
            Self::Rejected(_) => None,
        }
    }

    /// The policy's refusal, if that is what this is.
    pub fn rejected(&self) -> Option<&Rejected> {
        match self {
            Self::Inner(_) => None,
            Self::Rejected(r) => Some(r),
        }
    }

    /// Maps the operation's error, leaving refusals as they are.
    pub fn map_inner<F, E2>(self, f: F) -> PolicyError<E2>
    where
        F: FnOnce(E) -> E2,
    {
        match self {
            Self::Inner(e) => PolicyError::Inner(f(e)),
            Self::Rejected(r) => PolicyError::Rejected(r),
        }
    }
}

impl<E: Into<BoxError>> PolicyError<E> {
    /// Converts into a [`BoxError`], as tower services return: the
    /// operation's error as itself, a refusal as a boxed [`Rejected`] that
    /// [`find_cause`] and [`classify`] recognise.
    pub fn into_box_error(self) -> BoxError {
        match self {
            Self::Inner(e) => e.into(),
            Self::Rejected(r) => Box::new(r),
        }
    }
}

impl<E> PolicyError<PolicyError<E>> {
    /// Removes one level of nesting, as produced by calling one policy inside
    /// another's closure.
    pub fn flatten(self) -> PolicyError<E> {
        match self {
            Self::Inner(inner) => inner,
            Self::Rejected(r) => PolicyError::Rejected(r),
        }
    }
}

impl<E> From<Rejected> for PolicyError<E> {
    fn from(r: Rejected) -> Self {
        Self::Rejected(r)
    }
}

impl<E: Classify> Classify for PolicyError<E> {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Inner(e) => e.class(),
            Self::Rejected(r) => r.class(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Inner(e) => e.retry_after(),
            Self::Rejected(r) => r.retry_after(),
        }
    }
}

impl<E: fmt::Display> fmt::Display for PolicyError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Inner(e) => fmt::Display::fmt(e, f),
            Self::Rejected(r) => fmt::Display::fmt(r, f),
        }
    }
}

impl<E: StdError + 'static> StdError for PolicyError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::Inner(e) => Some(e),
            Self::Rejected(r) => Some(r),
        }
    }
}

impl<E: PartialEq> PartialEq for PolicyError<E> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Inner(a), Self::Inner(b)) => a == b,
            (Self::Rejected(a), Self::Rejected(b)) => a == b,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests;
