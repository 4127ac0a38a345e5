//! Retry: try a failed call again, after a growing, jittered delay, within a
//! budget and the request's deadline.
//!
//! A retry turns a transient failure into a success at the price of extra
//! load on the dependency, and that price is highest in an outage. So a
//! [`Retry`] repeats an attempt only when all of these hold:
//!
//! - the outcome is worth repeating: by default the error's
//!   [`ErrorClass`](keel_core::ErrorClass) is `Retryable`; an
//!   `OutcomeUnknown` error (a timeout after the request was sent) is
//!   repeated only if the operation is marked idempotent with
//!   [`retry_outcome_unknown`](RetryBuilder::retry_outcome_unknown), because
//!   the first attempt may have taken effect and a second would do it twice
//!   (charge a card twice). An error nobody classified (`Unclassified`) is
//!   not repeated: it is not known to be safe. Predicates on the error and on
//!   successful results ([`retry_if`](RetryBuilder::retry_if),
//!   [`retry_on_result`](RetryBuilder::retry_on_result); `http_verdict`
//!   for HTTP responses and `grpc_verdict` for gRPC statuses, feature `http`) override this;
//! - attempts are left ([`max_attempts`](RetryBuilder::max_attempts) counts
//!   the first one; default 3);
//! - a `Retry-After` the dependency sent ([`Classify::retry_after`](keel_core::Classify::retry_after))
//!   is no longer than [`retry_after_max`](RetryBuilder::retry_after_max)
//!   (default 30 s). The delay is then `max(backoff, Retry-After)`. If the
//!   dependency asks for longer, the call gives up at once and returns that
//!   error: ignoring the request would hammer a dependency that said it
//!   cannot cope, and waiting that long would hold the caller hostage;
//! - the delay plus [`MIN_TIME_TO_START`] fits before the current
//!   [`Deadline`]: a retry that cannot finish in time only adds load, so the
//!   call stops early and returns the last error;
//! - the [`RetryBudget`] (by default one per `Retry`, shared by its clones)
//!   has a token: during a widespread outage it empties and retries stop.
//!
//! When a retry is refused the caller gets the *last outcome* (the error,
//! or the result a predicate rejected), not a new error, unless it asked for
//! [`Rejected::BudgetExhausted`] with
//! [`reject_on_budget_exhausted`](RetryBuilder::reject_on_budget_exhausted).
//!
//! **An attempt that may have taken effect is never hidden by a later one.**
//! An idempotent call whose attempt timed out (the dependency may have
//! applied it and answered late) is retried; if the next attempt is then
//! refused before it is sent (an open breaker, a full bulkhead, the
//! deadline), or fails in a way that says only *it* did nothing (a `503`),
//! the call returns the earlier outcome of unknown effect, not the last
//! one, and never a budget refusal: a caller that keeps a record of what
//! may have happened (a saga compensating the step) must hear it. Only an
//! answer that settles the call ([`RetryPolicy::settles`]: a permanent
//! error, a success) replaces it. Such calls count
//! `keel_retry_maybe_applied_total{name}`.
//!
//! Delays come from a [`Backoff`] (default: 200 ms doubling up to 10 s, full
//! jitter).
//!
//! Observability: a `tracing` debug event and the counter
//! `keel_retry_attempts_total{name}` for every retry (attempts after the
//! first); `keel_retry_exhausted_total{name, reason}` when a retryable outcome
//! is returned because `attempts`, `retry_after` or `deadline` stopped it; the
//! budget counts `keel_retry_budget_exhausted_total{name}` under its own name.
//! Nothing is counted or allocated on a call that succeeds at once.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::Classified;
//! use keel_policy::retry::{Backoff, Retry};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let retry = Retry::builder("inventory").max_attempts(3).build()?;
//! let mut calls = 0;
//! let stock = retry
//!     .call(|| {
//!         calls += 1;
//!         let n = calls;
//!         async move {
//!             if n < 3 { Err(Classified::retryable("connection refused")) } else { Ok(42) }
//!         }
//!     })
//!     .await;
//! assert_eq!(stock.ok(), Some(42));
//! assert_eq!(calls, 3);
//! # Ok::<(), keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```
//!
//! [`MIN_TIME_TO_START`]: keel_core::deadline::MIN_TIME_TO_START
//! [`Deadline`]: keel_core::Deadline

pub(crate) mod attempts;
mod backoff;
mod budget;
mod config;
mod future;
mod jitter;
mod layer;
mod policy;
#[cfg(test)]
mod tests;

pub use backoff::{Backoff, BackoffConfig, Delays};
pub use budget::{RetryBudget, RetryBudgetBuilder, RetryBudgetConfig};
pub use config::{OnRetry, RetryBuilder, RetryConfig, RetryEvent};
pub use jitter::Jitter;
pub use layer::{ResponseFuture, RetryLayer, RetryService};
pub use policy::{ByClass, RetryIf, RetryOnResult, RetryPolicy, Verdict};
#[cfg(feature = "http")]
pub use policy::{grpc_verdict, http_verdict};

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_core::deadline::MIN_TIME_TO_START;
use keel_core::{Deadline, Name, PolicyError, Rejected};

use self::attempts::FnAttempts;
use self::backoff::Cursor;
use self::future::RetryFuture;
use self::jitter::Rand;

/// A retry policy. Clones share the configuration and the budget.
pub struct Retry<P = ByClass> {
    shared: Arc<Shared<P>>,
}

impl<P> Clone for Retry<P> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P> fmt::Debug for Retry<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("name", &self.shared.name)
            .field("config", &self.shared.config)
            .field("budget", &self.shared.budget)
            .finish_non_exhaustive()
    }
}

impl<P> Retry<P> {
    /// Runs `f`, and again while the outcome is worth retrying and the
    /// attempts, the budget and the deadline allow. Returns the last outcome;
    /// refusals only with [`reject_on_budget_exhausted`](RetryBuilder::reject_on_budget_exhausted).
    ///
    /// Like any future, it does nothing until polled.
    pub fn call<T, E, F, Fut>(&self, f: F) -> impl Future<Output = Result<T, PolicyError<E>>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        P: RetryPolicy<T, E>,
    {
        RetryFuture::new(&*self.shared, FnAttempts(f), None)
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.shared.name
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &RetryConfig {
        &self.shared.config
    }

    /// The backoff between attempts.
    pub fn backoff(&self) -> &Backoff {
        &self.shared.backoff
    }

    /// The budget its retries spend, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.shared.budget.as_ref()
    }

    /// A tower layer applying this policy.
    pub fn layer(&self) -> RetryLayer<P> {
        RetryLayer::new(self.clone())
    }

    pub(crate) fn shared(&self) -> &Arc<Shared<P>> {
        &self.shared
    }
}

/// The state all clones of a [`Retry`] share.
pub(crate) struct Shared<P> {
    name: Name,
    config: RetryConfig,
    max_attempts: u32,
    backoff: Backoff,
    retry_after_max: Duration,
    idempotent: bool,
    budget: Option<RetryBudget>,
    reject_on_budget_exhausted: bool,
    on_retry: Option<OnRetry>,
    seed: Option<u64>,
    seeded_calls: AtomicU64,
    pub(crate) policy: P,
    metrics: RetryMetrics,
}

/// Where one call stands: attempts started, and its backoff (created at the
/// first retry, so the happy path does not pay for it).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    attempts: u32,
    backoff: Option<Cursor>,
}

impl Progress {
    /// A call whose first attempt is already running.
    pub(crate) fn started() -> Self {
        Self {
            attempts: 1,
            backoff: None,
        }
    }

    /// Marks the first attempt as started; true if it had not been.
    pub(crate) fn begin(&mut self) -> bool {
        let first = self.attempts == 0;
        self.attempts = self.attempts.max(1);
        first
    }
}

/// Why a call is not retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The outcome is final (a success, or not worth retrying).
    Accepted,
    /// No attempts (or scheduled delays) left.
    Exhausted,
    /// The dependency asked to wait longer than `retry_after_max`.
    RetryAfterTooLong,
    /// The delay would not leave time to start before the deadline.
    Deadline,
    /// The budget is empty.
    Budget,
}

impl<P> Shared<P> {
    #[inline]
    pub(crate) fn record_request(&self) {
        if let Some(budget) = &self.budget {
            budget.deposit();
        }
    }

    /// The delay before the next attempt, or why there is none.
    pub(crate) fn next_retry(
        &self,
        verdict: Verdict,
        progress: &mut Progress,
    ) -> Result<Duration, Stop> {
        let after = match verdict {
            Verdict::Accept => return Err(Stop::Accepted),
            Verdict::RetryIfIdempotent { .. } if !self.idempotent => return Err(Stop::Accepted),
            Verdict::Retry { after } | Verdict::RetryIfIdempotent { after } => after,
        };
        if progress.attempts >= self.max_attempts {
            return Err(Stop::Exhausted);
        }
        let cursor = progress
            .backoff
            .get_or_insert_with(|| Cursor::new(self.rand()));
        let mut delay = self.backoff.advance(cursor).ok_or(Stop::Exhausted)?;
        if let Some(after) = after {
            if after > self.retry_after_max {
                return Err(Stop::RetryAfterTooLong);
            }
            delay = delay.max(after);
        }
        if Deadline::current()
            .is_some_and(|d| d.remaining() <= delay.saturating_add(MIN_TIME_TO_START))
        {
            return Err(Stop::Deadline);
        }
        if self.budget.as_ref().is_some_and(|b| !b.try_withdraw()) {
            return Err(Stop::Budget);
        }
        progress.attempts += 1;
        self.announce(progress.attempts, delay);
        Ok(delay)
    }

    /// Counts (and logs) a call that returns an earlier attempt's unknown
    /// outcome instead of its last one's.
    fn count_hidden_attempt(&self) {
        self.metrics.maybe_applied.increment(1);
        tracing::debug!(
            retry = %self.name,
            "an earlier attempt may have taken effect: returning its outcome, not the last one's"
        );
    }

    fn rand(&self) -> Rand {
        match self.seed {
            Some(seed) => {
                Rand::seeded(seed.wrapping_add(self.seeded_calls.fetch_add(1, Ordering::Relaxed)))
            }
            None => Rand::Thread,
        }
    }

    fn announce(&self, attempt: u32, delay: Duration) {
        self.metrics.attempts.increment(1);
        tracing::debug!(retry = %self.name, attempt, delay_ms = delay.as_millis() as u64, "retrying");
        if let Some(hook) = &self.on_retry {
            hook(&RetryEvent {
                name: &self.name,
                attempt,
                delay,
            });
        }
    }

    /// The call's result once an attempt's outcome was accepted: that
    /// outcome, unless it is a failure that does not settle an `earlier`
    /// attempt which may have taken effect (see [`RetryPolicy::settles`]).
    pub(crate) fn accept<T, E>(
        &self,
        outcome: Result<T, E>,
        earlier: Option<Result<T, E>>,
    ) -> Result<T, PolicyError<E>>
    where
        P: RetryPolicy<T, E>,
    {
        match (outcome, earlier) {
            (Err(error), Some(earlier)) if !self.policy.settles(&error) => {
                self.count_hidden_attempt();
                earlier.map_err(PolicyError::Inner)
            }
            (outcome, _) => outcome.map_err(PolicyError::Inner),
        }
    }

    /// The call's result once `stop` ended it: the last outcome, or a refusal
    /// if the budget stopped it and the caller asked for one. An `earlier`
    /// outcome that may have taken effect wins over both when the last one
    /// is known to have done nothing (its `verdict` was a plain retry),
    /// since that says nothing about what came before it.
    pub(crate) fn finish<T, E>(
        &self,
        outcome: Result<T, E>,
        verdict: Verdict,
        earlier: Option<Result<T, E>>,
        stop: Stop,
    ) -> Result<T, PolicyError<E>> {
        let unknown = verdict.may_have_taken_effect();
        let (outcome, maybe_applied) = match earlier {
            Some(earlier) if !unknown => {
                self.count_hidden_attempt();
                (earlier, true)
            }
            _ => (outcome, unknown),
        };
        let counter = match stop {
            Stop::Accepted => return outcome.map_err(PolicyError::Inner),
            Stop::Budget => {
                // A refusal says the call never left: only a call whose
                // attempts are all known to have done nothing may say so.
                if let (true, Some(budget), false) =
                    (self.reject_on_budget_exhausted, &self.budget, maybe_applied)
                {
                    return Err(PolicyError::Rejected(Rejected::BudgetExhausted {
                        name: *budget.name(),
                    }));
                }
                return outcome.map_err(PolicyError::Inner);
            }
            Stop::Exhausted => &self.metrics.exhausted_attempts,
            Stop::RetryAfterTooLong => &self.metrics.exhausted_retry_after,
            Stop::Deadline => &self.metrics.exhausted_deadline,
        };
        counter.increment(1);
        tracing::debug!(retry = %self.name, reason = ?stop, "giving up: returning the last outcome");
        outcome.map_err(PolicyError::Inner)
    }
}

/// Counter handles, created once when the policy is built.
struct RetryMetrics {
    attempts: metrics::Counter,
    exhausted_attempts: metrics::Counter,
    exhausted_retry_after: metrics::Counter,
    exhausted_deadline: metrics::Counter,
    maybe_applied: metrics::Counter,
}

impl RetryMetrics {
    fn new(name: &Name) -> Self {
        let exhausted = |reason: &'static str| metrics::counter!("keel_retry_exhausted_total", "name" => name.to_string(), "reason" => reason);
        Self {
            attempts: metrics::counter!("keel_retry_attempts_total", "name" => name.to_string()),
            exhausted_attempts: exhausted("attempts"),
            exhausted_retry_after: exhausted("retry_after"),
            exhausted_deadline: exhausted("deadline"),
            maybe_applied: metrics::counter!("keel_retry_maybe_applied_total", "name" => name.to_string()),
        }
    }
}
