//! A time limit on a call, which also becomes the deadline of everything the
//! call does.
//!
//! One [`Timeout`] type serves both places a timeout belongs: around a single
//! attempt (`perTryTimeout: 700ms`) and around the whole call, retries
//! included (`timeout: 2s`). Its effective limit is the smaller of its own
//! limit and the time left before the task's current
//! [`Deadline`]:
//!
//! - if less than [`min_time_to_start`](TimeoutBuilder::min_time_to_start)
//!   (50 ms by default) is left, the call is refused with
//!   [`Rejected::DeadlineExceeded`] and the operation is never started: work
//!   that cannot finish in time is work done for nobody;
//! - if the deadline is the binding constraint and passes, the call fails with
//!   [`Rejected::DeadlineExceeded`]; if the timeout's own limit passes first,
//!   with [`Rejected::Timeout`]. Either way the operation's future is dropped,
//!   which cancels it.
//!
//! # Why the timeout becomes the deadline
//!
//! With [`propagate_deadline`](TimeoutBuilder::propagate_deadline) (the
//! default), the operation runs inside
//! [`Deadline::scope`](keel_core::Deadline::scope) with the timeout's own
//! limit, so everything below it sees the tighter deadline: a retry policy
//! will not sleep past it or start an attempt with too little time left, a
//! per-attempt timeout is cut to what remains, and outgoing calls carry it in
//! `X-Request-Deadline-Unix-Ms`. That is what makes the mesh rule
//! "2 x 700ms + overhead MUST fit in 2s" enforceable rather than a comment: a
//! 2 s total timeout around retries with a 700 ms per-attempt timeout never
//! runs past 2 s, and the last attempt is given only the time that is left.
//! Turn it off only for leaf operations that call nothing else.
//!
//! Every stop is counted in `keel_timeout_total{name, reason}`, `reason`
//! being `timeout`, `deadline_exceeded` or `too_late_to_start`.
//!
//! Compared with `tower::timeout::Timeout`: the same cancel-on-elapse
//! behaviour, plus deadline awareness, a refusal to start too late, and a timer
//! that is only armed if the operation does not finish on its first poll (a
//! ready response costs no timer registration).
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::timeout::Timeout;
//! use keel_policy::{PolicyError, Rejected};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let timeout = Timeout::builder("pricing").timeout(Duration::from_millis(700)).build()?;
//!
//! let ok = timeout.call(|| async { Ok::<_, std::io::Error>(42) }).await;
//! assert_eq!(ok.unwrap(), 42);
//!
//! let slow = timeout
//!     .call(|| async {
//!         tokio::time::sleep(Duration::from_secs(5)).await;
//!         Ok::<_, std::io::Error>(42)
//!     })
//!     .await;
//! assert!(matches!(slow, Err(PolicyError::Rejected(Rejected::Timeout { .. }))));
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```

mod future;
mod layer;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Deadline, Name, PolicyError, Rejected};
use serde::{Deserialize, Serialize};

use crate::ConfigError;
use future::Elapsing;
pub use future::ResponseFuture;
pub use layer::{TimeoutLayer, TimeoutService};

/// The default time limit: 1 s, Resilience4j's `TimeLimiter` default. Set it
/// from the dependency's p99 latency and SLA rather than trusting it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// The configuration of a [`Timeout`], as read from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// The time limit (default [`DEFAULT_TIMEOUT`]). Must be more than zero.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Refuse to start when no more than this is left before the current
    /// deadline (default [`keel_core::deadline::MIN_TIME_TO_START`], 50 ms).
    #[serde(with = "humantime_serde")]
    pub min_time_to_start: Duration,
    /// Run the operation with the timeout as its deadline, so everything it
    /// calls sees it (default `true`).
    pub propagate_deadline: bool,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            min_time_to_start: keel_core::deadline::MIN_TIME_TO_START,
            propagate_deadline: true,
        }
    }
}

impl TimeoutConfig {
    /// Validates the configuration and builds the policy.
    pub fn build(self, name: impl Into<Name>) -> Result<Timeout, ConfigError> {
        ConfigError::ensure(
            !self.timeout.is_zero(),
            "timeout",
            "must be more than zero: a zero timeout fails every call",
        )?;
        Ok(Timeout {
            inner: Arc::new(Inner::new(name.into(), self)),
        })
    }
}

/// Builds a [`Timeout`]; see the setters for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct TimeoutBuilder {
    name: Name,
    config: TimeoutConfig,
}

impl TimeoutBuilder {
    /// The time limit (default [`DEFAULT_TIMEOUT`], 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Refuse to start a call when no more than this is left before the
    /// current deadline (default 50 ms). Zero refuses only once the deadline
    /// has passed.
    pub fn min_time_to_start(mut self, min: Duration) -> Self {
        self.config.min_time_to_start = min;
        self
    }

    /// Whether the operation runs with this timeout as its current deadline
    /// (default `true`); see the [module docs](self) for why.
    pub fn propagate_deadline(mut self, propagate: bool) -> Self {
        self.config.propagate_deadline = propagate;
        self
    }

    /// Validates the settings and builds the policy.
    pub fn build(self) -> Result<Timeout, ConfigError> {
        self.config.build(self.name)
    }
}

/// A time limit on calls, aware of the current deadline. Clones share one
/// policy; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Timeout {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: Name,
    limit: Duration,
    min_time_to_start: Duration,
    propagate: bool,
    timed_out: metrics::Counter,
    deadline_exceeded: metrics::Counter,
    refused_to_start: metrics::Counter,
}

impl Inner {
    fn new(name: Name, config: TimeoutConfig) -> Self {
        let counter = |reason: &'static str| metrics::counter!("keel_timeout_total", "name" => name.to_string(), "reason" => reason);
        Self {
            timed_out: counter("timeout"),
            deadline_exceeded: counter("deadline_exceeded"),
            refused_to_start: counter("too_late_to_start"),
            limit: config.timeout,
            min_time_to_start: config.min_time_to_start,
            propagate: config.propagate_deadline,
            name,
        }
    }
}

/// When a started call must end, and which limit that is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    at: Instant,
    deadline_binds: bool,
    propagate: bool,
}

impl Plan {
    /// The deadline the operation runs under, if it must be set.
    pub(crate) fn scope(&self) -> Option<Deadline> {
        self.propagate.then(|| Deadline::at(self.at))
    }

    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    pub(crate) fn deadline_binds(&self) -> bool {
        self.deadline_binds
    }
}

impl Timeout {
    /// A builder named after the dependency it guards, with the defaults.
    pub fn builder(name: impl Into<Name>) -> TimeoutBuilder {
        TimeoutBuilder {
            name: name.into(),
            config: TimeoutConfig::default(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// The configured time limit.
    pub fn limit(&self) -> Duration {
        self.inner.limit
    }

    /// A tower layer applying this timeout.
    pub fn layer(&self) -> TimeoutLayer {
        TimeoutLayer::new(self.clone())
    }

    /// Runs `f` with the time limit, counted from the first poll of the
    /// returned future. The operation is never started if the current
    /// deadline is too close, and is dropped (cancelled) when the limit
    /// passes. Its own error is returned as [`PolicyError::Inner`].
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call_from(clock::now(), f).await
    }

    /// [`call`](Self::call), with `now` read by the caller a moment ago: a
    /// [`Pipeline`](crate::pipeline::Pipeline) reads the clock once for its
    /// total timeout and its first attempt's. An instant a little in the
    /// past only makes the limit a little tighter.
    pub(crate) async fn call_from<T, E, F, Fut>(
        &self,
        now: Instant,
        f: F,
    ) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let enclosing = Deadline::current();
        let plan = self.plan_at(now, enclosing)?;
        let outcome = match plan.scope() {
            Some(deadline) => {
                let scoped = deadline.scope(async move { f().await });
                Elapsing::new(scoped, plan.at).await
            }
            None => Elapsing::new(f(), plan.at).await,
        };
        match outcome {
            Some(result) => result.map_err(PolicyError::Inner),
            None => Err(self.elapsed(plan.deadline_binds).into()),
        }
    }

    /// Decides whether a call may start now, and when it must end.
    #[inline]
    pub(crate) fn plan(&self) -> Result<Plan, Rejected> {
        self.plan_at(clock::now(), Deadline::current())
    }

    /// [`plan`](Self::plan) as of `now`, in a task whose current deadline
    /// is `enclosing`.
    #[inline]
    fn plan_at(&self, now: Instant, enclosing: Option<Deadline>) -> Result<Plan, Rejected> {
        let inner = &*self.inner;
        let own = saturating_add(now, inner.limit);
        let Some(deadline) = enclosing else {
            return Ok(self.own_plan(own));
        };
        let remaining = deadline.instant().saturating_duration_since(now);
        if remaining <= inner.min_time_to_start {
            return Err(self.refuse_start(remaining));
        }
        if deadline.instant() < own {
            // The deadline is already the current one: no scope needed.
            Ok(Plan {
                at: deadline.instant(),
                deadline_binds: true,
                propagate: false,
            })
        } else {
            Ok(self.own_plan(own))
        }
    }

    #[inline]
    fn own_plan(&self, at: Instant) -> Plan {
        Plan {
            at,
            deadline_binds: false,
            propagate: self.inner.propagate,
        }
    }

    #[cold]
    fn refuse_start(&self, remaining: Duration) -> Rejected {
        let inner = &*self.inner;
        inner.refused_to_start.increment(1);
        tracing::debug!(
            timeout = %inner.name,
            ?remaining,
            min_time_to_start = ?inner.min_time_to_start,
            "refused to start: too little time left before the deadline"
        );
        Rejected::DeadlineExceeded
    }

    /// The refusal for a call whose limit passed; `deadline_binds` says
    /// whether that limit was the deadline's rather than the timeout's own.
    #[cold]
    pub(crate) fn elapsed(&self, deadline_binds: bool) -> Rejected {
        let inner = &*self.inner;
        if deadline_binds {
            inner.deadline_exceeded.increment(1);
            tracing::debug!(timeout = %inner.name, "deadline exceeded; call cancelled");
            Rejected::DeadlineExceeded
        } else {
            inner.timed_out.increment(1);
            tracing::debug!(timeout = %inner.name, after = ?inner.limit, "timed out; call cancelled");
            Rejected::Timeout {
                name: inner.name,
                after: inner.limit,
            }
        }
    }
}

#[inline]
fn saturating_add(now: Instant, limit: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    now.checked_add(limit)
        .or_else(|| now.checked_add(FAR))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(limit_ms: u64) -> Timeout {
        Timeout::builder("test")
            .timeout(Duration::from_millis(limit_ms))
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn own_limit_binds_without_a_deadline() {
        let plan = policy(700).plan().unwrap();
        assert!(!plan.deadline_binds);
        assert_eq!(plan.at, clock::now() + Duration::from_millis(700));
        assert_eq!(plan.scope(), Some(Deadline::at(plan.at)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_closer_deadline_binds_and_is_not_rescoped() {
        let deadline = Deadline::after(Duration::from_millis(300));
        let plan = deadline.scope(async { policy(700).plan() }).await.unwrap();
        assert!(plan.deadline_binds);
        assert_eq!(plan.at, deadline.instant());
        assert_eq!(plan.scope(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_deadline_does_not_bind() {
        let deadline = Deadline::after(Duration::from_secs(2));
        let plan = deadline.scope(async { policy(700).plan() }).await.unwrap();
        assert!(!plan.deadline_binds);
    }

    #[tokio::test(start_paused = true)]
    async fn too_little_time_left_is_refused() {
        let deadline = Deadline::after(Duration::from_millis(50));
        let plan = deadline.scope(async { policy(700).plan() }).await;
        assert_eq!(plan.unwrap_err(), Rejected::DeadlineExceeded);
    }

    #[test]
    fn huge_limits_saturate() {
        let now = clock::now();
        assert!(saturating_add(now, Duration::MAX) > now);
    }

    #[test]
    fn zero_timeout_is_rejected() {
        let err = Timeout::builder("t")
            .timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "timeout");
    }
}
