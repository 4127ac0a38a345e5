//! An adaptive concurrency limit: how many calls may be in flight, learned
//! from the dependency's round trips and failures instead of guessed.
//!
//! A fixed limit is either too low (wasted capacity) or too high (queueing
//! and timeouts once the dependency slows). [`AdaptiveLimit`] refuses calls
//! beyond its current limit with [`Rejected::Overloaded`], and after every
//! call feeds the round trip and outcome to a [`LimitAlgorithm`]:
//!
//! - [`Aimd`]: additive increase while the limit is in use, multiplicative
//!   decrease (× 0.9) on every drop.
//! - [`Gradient`] (the default): grows while round trips stay near the
//!   shortest recently seen, shrinks as they stretch.
//!
//! # What counts as a drop
//!
//! A call that is cancelled (for example by an outer timeout), takes at
//! least `timeout`, or fails with a dependency failure or a refusal (any
//! error not classified [`Permanent`](keel_core::ErrorClass::Permanent),
//! errors nobody classified included).
//! Permanent errors say nothing about load: the slot is freed, no sample
//! is taken. Drops never raise the limit, so steady timeouts drive it to
//! `min_limit` and keep it there, rather than letting it run away to
//! `max_limit`.
//!
//! The current limit is published as the `keel_adaptive_limit` gauge.
//! Admission is one atomic operation; learning takes a short lock, and
//! under contention a success that finds it taken is not sampled (drops
//! always are), so learning never makes callers queue.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! use keel_policy::adaptive::{AdaptiveLimit, AimdConfig};
//!
//! let limit = AdaptiveLimit::builder("search").limits(10, 1, 100).aimd(AimdConfig::default()).build().unwrap();
//! let answer = limit.call(|| async { Ok::<_, std::io::Error>(42) }).await;
//! assert_eq!(answer.unwrap(), 42);
//! assert_eq!(limit.in_flight(), 0);
//! # });
//! ```

mod algorithm;
mod config;
mod layer;

use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::{
    BoxError, Classify, ErrorClass, Name, PolicyError, Rejected, clock, error::classify,
};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::admission::Permit;

pub use algorithm::{Aimd, Gradient, LimitAlgorithm, Outcome, Sample};
pub use config::{AdaptiveBuilder, AdaptiveConfig, AimdConfig, AlgorithmConfig, GradientConfig};
/// The response future of an [`AdaptiveLimitService`]: the inner response,
/// whose ending (or cancellation) is learned from, or a refusal.
pub type ResponseFuture<F> = crate::admission::ResponseFuture<F, InFlightCall>;
pub use layer::{AdaptiveLimitLayer, AdaptiveLimitService};

/// A concurrency limit that adapts to the dependency; see the
/// [module docs](self).
///
/// Clones share the same limit.
#[derive(Clone)]
pub struct AdaptiveLimit {
    shared: Arc<Shared>,
}

struct Shared {
    name: Name,
    in_flight: AtomicUsize,
    limit: AtomicUsize,
    state: Mutex<State>,
    min_limit: usize,
    max_limit: usize,
    timeout: Duration,
    retry_after: Duration,
    limit_gauge: metrics::Gauge,
    rejected_total: metrics::Counter,
}

/// The algorithm and the exact limit it works on; the atomic `limit` is
/// its whole part, published for lock-free admission.
struct State {
    algorithm: Box<dyn LimitAlgorithm>,
    estimate: f64,
}

impl AdaptiveLimit {
    /// Starts building a policy named `name`.
    pub fn builder(name: impl Into<Name>) -> AdaptiveBuilder {
        AdaptiveBuilder::new(name.into())
    }

    fn new(name: Name, config: &AdaptiveConfig, algorithm: Box<dyn LimitAlgorithm>) -> Self {
        let labels = [("name", name.as_str())];
        let limit_gauge = metrics::gauge!("keel_adaptive_limit", &labels);
        limit_gauge.set(config.initial_limit as f64);
        let shared = Shared {
            rejected_total: metrics::counter!("keel_adaptive_rejected_total", &labels),
            limit_gauge,
            name,
            in_flight: AtomicUsize::new(0),
            limit: AtomicUsize::new(config.initial_limit),
            state: Mutex::new(State {
                algorithm,
                estimate: config.initial_limit as f64,
            }),
            min_limit: config.min_limit,
            max_limit: config.max_limit,
            timeout: config.timeout,
            retry_after: config.retry_after,
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Runs `f` if fewer calls than the limit are in flight, and learns
    /// from how it ends; refuses with [`Rejected::Overloaded`] otherwise.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Classify,
    {
        let in_flight = self.shared.enter().map(InFlight::new)?;
        let result = f().await;
        in_flight.finish(outcome_of(result.as_ref().err().map(Classify::class)));
        result.map_err(PolicyError::Inner)
    }

    /// The current limit.
    pub fn limit(&self) -> usize {
        self.shared.limit.load(Ordering::Relaxed)
    }

    /// How many calls are in flight now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.shared.name
    }

    fn enter_owned(&self) -> Result<InFlightCall, Rejected> {
        self.shared.enter()?;
        Ok(InFlightCall(InFlight::new(Arc::clone(&self.shared))))
    }
}

impl Shared {
    /// Counts a call in, if fewer than the limit are in flight.
    #[inline]
    fn enter(&self) -> Result<&Self, Rejected> {
        let admitted = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.limit.load(Ordering::Relaxed)).then_some(n + 1)
            });
        match admitted {
            Ok(_) => Ok(self),
            Err(_) => Err(self.refuse()),
        }
    }

    fn refuse(&self) -> Rejected {
        self.rejected_total.increment(1);
        tracing::debug!(adaptive = %self.name, limit = self.limit.load(Ordering::Relaxed), "limit reached: call refused");
        Rejected::Overloaded {
            name: self.name,
            retry_after: self.retry_after,
        }
    }

    /// Counts a call out and, unless it is to be ignored, learns from it.
    fn complete(&self, started: Instant, outcome: Option<Outcome>) {
        let in_flight = self.in_flight.fetch_sub(1, Ordering::AcqRel);
        let Some(outcome) = outcome else { return };
        let at = clock::now();
        let rtt = at.saturating_duration_since(started);
        let outcome = if rtt >= self.timeout {
            Outcome::Dropped
        } else {
            outcome
        };
        self.learn(&Sample {
            rtt,
            in_flight,
            outcome,
            at,
        });
    }

    fn learn(&self, sample: &Sample) {
        // Under contention a success may skip its sample (others are being
        // taken); a drop always waits its turn, so no congestion signal is
        // lost.
        let mut guard = match sample.outcome {
            Outcome::Success => match self.state.try_lock() {
                Some(guard) => guard,
                None => return,
            },
            Outcome::Dropped => self.state.lock(),
        };
        let state = &mut *guard;
        let estimate = state.algorithm.update(state.estimate, sample);
        let (min, max) = (self.min_limit as f64, self.max_limit as f64);
        // A NaN from a custom algorithm keeps the old limit.
        state.estimate = if estimate.is_nan() {
            state.estimate
        } else {
            estimate.clamp(min, max)
        };
        let limit = state.estimate as usize;
        // Only learners store the limit, under the lock: load, then store.
        if self.limit.load(Ordering::Relaxed) != limit {
            self.limit.store(limit, Ordering::Relaxed);
            self.limit_gauge.set(limit as f64);
            tracing::debug!(adaptive = %self.name, limit, rtt = ?sample.rtt, outcome = ?sample.outcome, "limit changed");
        }
    }
}

/// A counted-in call; counted out, with the sample its ending gives, when
/// finished, or as dropped if it is dropped unfinished (cancelled).
struct InFlight<H: Borrow<Shared>> {
    shared: H,
    started: Instant,
    finished: bool,
}

impl<H: Borrow<Shared>> InFlight<H> {
    fn new(shared: H) -> Self {
        Self {
            shared,
            started: clock::now(),
            finished: false,
        }
    }

    /// Counts the call out: `None` frees the slot without a sample.
    fn finish(mut self, outcome: Option<Outcome>) {
        self.finished = true;
        self.shared.borrow().complete(self.started, outcome);
    }
}

impl<H: Borrow<Shared>> Drop for InFlight<H> {
    fn drop(&mut self) {
        if !self.finished {
            self.shared
                .borrow()
                .complete(self.started, Some(Outcome::Dropped));
        }
    }
}

impl<H: Borrow<Shared>> fmt::Debug for InFlight<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("started", &self.started)
            .finish_non_exhaustive()
    }
}

/// A call counted in by an [`AdaptiveLimitService`], counted out with what
/// its ending says about load when its response is in.
#[derive(Debug)]
pub struct InFlightCall(InFlight<Arc<Shared>>);

impl Permit for InFlightCall {
    fn release(self, error: Option<&BoxError>) {
        self.0
            .finish(outcome_of(error.map(|err| classify(err.as_ref()))));
    }
}

/// What a call's ending says about load: no error is a success; a
/// permanent error says nothing; any other failure is a drop.
fn outcome_of(error: Option<ErrorClass>) -> Option<Outcome> {
    match error {
        None => Some(Outcome::Success),
        Some(ErrorClass::Permanent) => None,
        Some(_) => Some(Outcome::Dropped),
    }
}

impl fmt::Debug for AdaptiveLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveLimit")
            .field("name", &self.shared.name)
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(config: AdaptiveConfig) -> &'static str {
        config.build("a").unwrap_err().field
    }

    #[test]
    fn invalid_settings_are_refused() {
        let base = AdaptiveConfig::default;
        assert_eq!(
            refused(AdaptiveConfig {
                min_limit: 0,
                initial_limit: 0,
                ..base()
            }),
            "min_limit"
        );
        assert_eq!(
            refused(AdaptiveConfig {
                max_limit: 0,
                ..base()
            }),
            "max_limit"
        );
        assert_eq!(
            refused(AdaptiveConfig {
                initial_limit: 500,
                ..base()
            }),
            "initial_limit"
        );
        assert_eq!(
            refused(AdaptiveConfig {
                timeout: Duration::ZERO,
                ..base()
            }),
            "timeout"
        );
        assert_eq!(
            refused(AdaptiveConfig {
                retry_after: Duration::ZERO,
                ..base()
            }),
            "retry_after"
        );
        let aimd = |backoff_ratio| AdaptiveConfig {
            algorithm: AlgorithmConfig::Aimd(AimdConfig { backoff_ratio }),
            ..base()
        };
        assert_eq!(refused(aimd(1.0)), "backoff_ratio");
        assert_eq!(refused(aimd(f64::NAN)), "backoff_ratio");
        let gradient = |g: GradientConfig| AdaptiveConfig {
            algorithm: AlgorithmConfig::Gradient(g),
            ..base()
        };
        let g = GradientConfig::default;
        assert_eq!(
            refused(gradient(GradientConfig {
                smoothing: 0.0,
                ..g()
            })),
            "smoothing"
        );
        assert_eq!(
            refused(gradient(GradientConfig {
                tolerance: 0.5,
                ..g()
            })),
            "tolerance"
        );
        assert_eq!(
            refused(gradient(GradientConfig {
                tolerance: f64::INFINITY,
                ..g()
            })),
            "tolerance"
        );
        assert_eq!(
            refused(gradient(GradientConfig {
                backoff_ratio: -0.1,
                ..g()
            })),
            "backoff_ratio"
        );
        assert_eq!(
            refused(gradient(GradientConfig {
                min_rtt_window: Duration::ZERO,
                ..g()
            })),
            "min_rtt_window"
        );
    }

    #[test]
    fn the_config_round_trips_and_refuses_unknown_fields() {
        let config = AdaptiveConfig::default();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(
            serde_json::from_str::<AdaptiveConfig>(&json).unwrap(),
            config
        );
        let aimd: AdaptiveConfig =
            serde_json::from_str(r#"{"algorithm": {"kind": "aimd"}}"#).unwrap();
        assert_eq!(aimd.algorithm, AlgorithmConfig::Aimd(AimdConfig::default()));
        assert!(serde_json::from_str::<AdaptiveConfig>(r#"{"limit": 3}"#).is_err());
        assert!(
            serde_json::from_str::<AdaptiveConfig>(
                r#"{"algorithm": {"kind": "aimd", "ratio": 0.5}}"#
            )
            .is_err()
        );
        assert!(
            serde_json::from_str::<AdaptiveConfig>(r#"{"algorithm": {"kind": "vegas"}}"#).is_err()
        );
    }

    #[test]
    fn a_permanent_error_frees_the_slot_without_a_sample() {
        assert_eq!(outcome_of(None), Some(Outcome::Success));
        assert_eq!(outcome_of(Some(ErrorClass::Permanent)), None);
        assert_eq!(
            outcome_of(Some(ErrorClass::OutcomeUnknown)),
            Some(Outcome::Dropped)
        );
        assert_eq!(
            outcome_of(Some(ErrorClass::Rejected)),
            Some(Outcome::Dropped)
        );
        assert_eq!(
            outcome_of(Some(ErrorClass::Unclassified)),
            Some(Outcome::Dropped)
        );
    }
}
