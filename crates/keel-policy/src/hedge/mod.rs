//! Hedging: when an attempt is slower than usual, start another and take
//! whichever succeeds first.
//!
//! Tail latency is mostly bad luck: a GC pause, a cold cache, a busy
//! replica. Waiting for the slow attempt costs the whole p99; a second
//! attempt on another connection usually finishes in typical time. Hedging
//! trades a little extra load for a much shorter tail:
//!
//! - the first attempt starts at once; if it has not finished after the
//!   hedge delay, another starts (up to
//!   [`max_hedged_attempts`](HedgeBuilder::max_hedged_attempts), default 1),
//!   each one delay after the previous;
//! - the delay is fixed, or (the default) the p95 of recent successful
//!   latencies, so only the slowest ~5% of calls are hedged. Until
//!   `min_samples` successes were seen, a fixed fallback is used;
//! - the first *success* wins and the other attempts are dropped, which
//!   cancels them. A failure does not end the call while another attempt is
//!   still running; when the last one fails, its error is returned;
//! - each hedge spends a token of the [`RetryBudget`] (one per `Hedge` by
//!   default): a dependency that is slow for everyone gets no extra load;
//! - no hedge starts when the current [`Deadline`] leaves less than
//!   [`MIN_TIME_TO_START`].
//!
//! Only hedge idempotent operations: every attempt may take effect.
//!
//! A call whose first attempt finishes before the delay allocates nothing
//! and arms no timer (with a percentile delay, it reads the clock twice).
//!
//! Observability: `keel_hedge_attempts_total{name}` per hedge started,
//! `keel_hedge_wins_total{name}` when a hedge beat the first attempt,
//! `keel_hedge_skipped_total{name, reason}` when the `budget` or the
//! `deadline` held a hedge back, each with a `tracing` debug event.
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::hedge::{Hedge, HedgeDelay};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let hedge = Hedge::builder("search").delay(HedgeDelay::fixed(Duration::from_millis(50))).build()?;
//! let mut attempt = 0;
//! let answer = hedge
//!     .call(|| {
//!         attempt += 1;
//!         let slow = attempt == 1;
//!         async move {
//!             if slow {
//!                 tokio::time::sleep(Duration::from_secs(5)).await; // a slow replica
//!             }
//!             Ok::<_, std::io::Error>(attempt)
//!         }
//!     })
//!     .await;
//! assert_eq!(answer.ok(), Some(2)); // the hedge won, after 50 ms
//! # Ok::<(), keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```
//!
//! [`Deadline`]: keel_core::Deadline
//! [`MIN_TIME_TO_START`]: keel_core::deadline::MIN_TIME_TO_START

mod config;
mod future;
mod latency;
mod layer;
#[cfg(test)]
mod tests;

pub use config::{HedgeBuilder, HedgeConfig, HedgeDelay};
pub use layer::{HedgeLayer, HedgeService, ResponseFuture};

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::deadline::MIN_TIME_TO_START;
use keel_core::{Deadline, Name, PolicyError};

use self::future::HedgeFuture;
use self::latency::LatencyWindow;
use crate::ConfigError;
use crate::retry::RetryBudget;
use crate::retry::attempts::FnAttempts;

/// A hedging policy. Clones share the latency window and the budget.
#[derive(Clone)]
pub struct Hedge {
    shared: Arc<Shared>,
}

impl fmt::Debug for Hedge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hedge")
            .field("name", &self.shared.name)
            .field("config", &self.shared.config)
            .field("delay", &self.shared.delay())
            .finish_non_exhaustive()
    }
}

impl Hedge {
    pub(super) fn from_parts(
        name: Name,
        config: HedgeConfig,
        budget: Option<RetryBudget>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let budget = match (budget, &config.budget) {
            (Some(shared), _) => Some(shared),
            (None, Some(own)) => Some(own.clone().build(name)?),
            (None, None) => None,
        };
        let delay = match &config.delay {
            HedgeDelay::Fixed { delay } => DelaySource::Fixed(*delay),
            HedgeDelay::Percentile {
                percentile,
                min_samples,
                window,
                fallback,
            } => DelaySource::Percentile(LatencyWindow::new(
                *percentile,
                *window,
                *min_samples,
                *fallback,
            )),
        };
        let shared = Shared {
            metrics: HedgeMetrics::new(&name),
            max_hedges: config.max_hedged_attempts,
            delay,
            budget,
            name,
            config,
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// Runs `f`; if it has not finished after the hedge delay, runs it again
    /// concurrently (within the limit, budget and deadline), and returns the
    /// first success, or the error of the last attempt to fail.
    ///
    /// Like any future, it does nothing until polled.
    pub fn call<T, E, F, Fut>(&self, f: F) -> impl Future<Output = Result<T, PolicyError<E>>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        HedgeFuture::new(&*self.shared, FnAttempts(f))
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.shared.name
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &HedgeConfig {
        &self.shared.config
    }

    /// The delay after which a hedge would start now.
    pub fn current_delay(&self) -> Duration {
        self.shared.delay()
    }

    /// The budget hedges spend, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.shared.budget.as_ref()
    }

    /// A tower layer applying this policy.
    pub fn layer(&self) -> HedgeLayer {
        HedgeLayer::new(self.clone())
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

enum DelaySource {
    Fixed(Duration),
    Percentile(LatencyWindow),
}

/// The state all clones of a [`Hedge`] share.
pub(crate) struct Shared {
    name: Name,
    config: HedgeConfig,
    max_hedges: u32,
    delay: DelaySource,
    budget: Option<RetryBudget>,
    metrics: HedgeMetrics,
}

impl Shared {
    #[inline]
    pub(crate) fn record_request(&self) {
        if let Some(budget) = &self.budget {
            budget.deposit();
        }
    }

    fn delay(&self) -> Duration {
        match &self.delay {
            DelaySource::Fixed(delay) => *delay,
            DelaySource::Percentile(window) => window.delay(),
        }
    }

    /// The start of an attempt, when latencies are observed (percentile delay only).
    #[inline]
    pub(crate) fn start_clock(&self) -> Option<Instant> {
        match self.delay {
            DelaySource::Fixed(_) => None,
            DelaySource::Percentile(_) => Some(clock::now()),
        }
    }

    #[inline]
    fn record_success(&self, started: Option<Instant>, by_hedge: bool) {
        if let (DelaySource::Percentile(window), Some(started)) = (&self.delay, started) {
            window.record(clock::now().saturating_duration_since(started));
        }
        if by_hedge {
            self.metrics.wins.increment(1);
        }
    }

    /// Whether a hedge may start now: time left, and a token in the budget.
    fn may_hedge(&self) -> bool {
        if Deadline::current().is_some_and(|d| d.too_late_to_start(MIN_TIME_TO_START)) {
            self.metrics.skipped_deadline.increment(1);
            tracing::debug!(hedge = %self.name, "not hedging: too close to the deadline");
            return false;
        }
        if self.budget.as_ref().is_some_and(|b| !b.try_withdraw()) {
            self.metrics.skipped_budget.increment(1);
            tracing::debug!(hedge = %self.name, "not hedging: the retry budget is empty");
            return false;
        }
        true
    }

    fn announce_hedge(&self, hedge: u32) {
        self.metrics.hedges.increment(1);
        tracing::debug!(hedge = %self.name, number = hedge, "attempt is slow: hedging");
    }
}

/// Counter handles, created once when the policy is built.
struct HedgeMetrics {
    hedges: metrics::Counter,
    wins: metrics::Counter,
    skipped_budget: metrics::Counter,
    skipped_deadline: metrics::Counter,
}

impl HedgeMetrics {
    fn new(name: &Name) -> Self {
        let skipped = |reason: &'static str| metrics::counter!("keel_hedge_skipped_total", "name" => name.to_string(), "reason" => reason);
        Self {
            hedges: metrics::counter!("keel_hedge_attempts_total", "name" => name.to_string()),
            wins: metrics::counter!("keel_hedge_wins_total", "name" => name.to_string()),
            skipped_budget: skipped("budget"),
            skipped_deadline: skipped("deadline"),
        }
    }
}
