//! A rate limiter caps how many calls start per unit of time, so a caller
//! (or each tenant, with [`KeyedRateLimiter`]) gets a fair, bounded share.
//!
//! The algorithm is GCRA, from [`governor`]: it is a token bucket without a
//! refill task, one atomic word of state per limit, and it knows exactly
//! when the next call would conform, which becomes the refusal's
//! `retry_after` and so the edge's `Retry-After` header.
//!
//! # Choices, and why
//!
//! - Time is tokio's ([`TokioClock`]), so limits follow
//!   `tokio::time::pause()` in tests like every other policy.
//! - [`call`](RateLimiter::call) and the tower services refuse at once with
//!   [`Rejected::RateLimited`]: a server should answer `429` + `Retry-After`
//!   rather than hold the connection. A client pacing itself uses
//!   [`acquire`](RateLimiter::acquire) or
//!   [`call_waiting`](RateLimiter::call_waiting), which wait until the call
//!   conforms but never past the current [`Deadline`]: if the wait would
//!   end after it, they refuse at once.
//! - Defaults: 100 calls per second, bursts of one period's worth.
//! - A keyed limiter's memory is bounded; see [`KeyedRateLimiter`].
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! use std::time::Duration;
//! use keel_policy::{rate_limit::RateLimiter, Rejected};
//!
//! let limiter = RateLimiter::builder("search").rate(2, Duration::from_secs(1)).build().unwrap();
//! assert!(limiter.check().is_ok());
//! assert!(limiter.check().is_ok());
//! let refused = limiter.check().unwrap_err();
//! assert_eq!(refused.retry_after(), Some(Duration::from_millis(500)));
//! tokio::time::advance(Duration::from_millis(500)).await;
//! assert!(limiter.check().is_ok());
//! # });
//! ```

mod clock;
mod config;
mod keyed;
mod layer;
mod store;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{NotUntil, Quota};
use keel_core::{Deadline, Name, PolicyError, Rejected};

pub use clock::TokioClock;
pub use config::{RateLimitBuilder, RateLimitConfig};
/// The response future of the rate limiting services: the inner response,
/// or a refusal.
pub type ResponseFuture<F> = crate::admission::ResponseFuture<F, ()>;
pub use keyed::KeyedRateLimiter;
pub use layer::{KeyedRateLimitLayer, KeyedRateLimitService, RateLimitLayer, RateLimitService};

type Gcra = governor::RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Nanos>>;

/// Limits the rate of calls; see the [module docs](self).
///
/// Clones share the same limit.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    gcra: Gcra,
    refusals: Refusals,
}

/// Where refusals are counted and reported.
#[derive(Debug)]
struct Refusals {
    name: Name,
    rejected_total: metrics::Counter,
}

impl Refusals {
    fn new(name: Name) -> Self {
        let rejected_total =
            metrics::counter!("keel_rate_limit_rejected_total", "name" => name.as_str());
        Self {
            name,
            rejected_total,
        }
    }

    fn refuse(&self, retry_after: Duration) -> Rejected {
        self.rejected_total.increment(1);
        tracing::debug!(rate_limit = %self.name, ?retry_after, "rate limit refused a call");
        Rejected::RateLimited {
            name: self.name,
            retry_after,
        }
    }
}

impl RateLimiter {
    /// Starts building a rate limiter named `name`.
    pub fn builder(name: impl Into<Name>) -> RateLimitBuilder {
        RateLimitBuilder::new(name.into())
    }

    fn new(name: Name, quota: Quota) -> Self {
        let shared = Shared {
            gcra: governor::RateLimiter::direct_with_clock(quota, TokioClock::new()),
            refusals: Refusals::new(name),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Takes one call's worth of the limit now, or refuses with
    /// [`Rejected::RateLimited`] saying when a call would conform.
    #[inline]
    pub fn check(&self) -> Result<(), Rejected> {
        let gcra = &self.shared.gcra;
        gcra.check().map_err(|not_until| {
            self.shared
                .refusals
                .refuse(wait_time(gcra.clock(), &not_until))
        })
    }

    /// Waits until a call conforms and takes it, but never past the current
    /// [`Deadline`]: if the wait would end after it, refuses at once.
    pub async fn acquire(&self) -> Result<(), Rejected> {
        let gcra = &self.shared.gcra;
        wait_until_conforming(|| gcra.check(), gcra.clock(), &self.shared.refusals).await
    }

    /// Runs `f` if the limit allows a call now; refuses at once otherwise.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.check()?;
        f().await.map_err(PolicyError::Inner)
    }

    /// Runs `f` once the limit allows, waiting as [`acquire`](Self::acquire)
    /// does.
    pub async fn call_waiting<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.acquire().await?;
        f().await.map_err(PolicyError::Inner)
    }

    /// The limiter's name.
    pub fn name(&self) -> &Name {
        &self.shared.refusals.name
    }
}

/// How long from now until the refused call would conform.
fn wait_time(clock: &TokioClock, not_until: &NotUntil<Nanos>) -> Duration {
    not_until.wait_time_from(clock.now())
}

/// Retries `check` after each wait governor computes, refusing as soon as
/// the next wait would outlast the current deadline.
async fn wait_until_conforming(
    check: impl Fn() -> Result<(), NotUntil<Nanos>>,
    clock: &TokioClock,
    refusals: &Refusals,
) -> Result<(), Rejected> {
    loop {
        let wait = match check() {
            Ok(()) => return Ok(()),
            Err(not_until) => wait_time(clock, &not_until),
        };
        if Deadline::current().is_some_and(|deadline| deadline.remaining() < wait) {
            return Err(refusals.refuse(wait));
        }
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(config: RateLimitConfig) -> &'static str {
        config.build("r").unwrap_err().field
    }

    #[test]
    fn invalid_settings_are_refused() {
        let base = RateLimitConfig::default;
        assert_eq!(refused(RateLimitConfig { rate: 0, ..base() }), "rate");
        assert_eq!(
            refused(RateLimitConfig {
                period: Duration::ZERO,
                ..base()
            }),
            "period"
        );
        assert_eq!(
            refused(RateLimitConfig {
                burst: Some(0),
                ..base()
            }),
            "burst"
        );
        let too_fast = RateLimitConfig {
            rate: 1_000,
            period: Duration::from_nanos(10),
            ..base()
        };
        assert_eq!(refused(too_fast), "rate");
        let too_slow = RateLimitConfig {
            rate: 1,
            period: Duration::from_secs(u64::MAX / 4),
            ..base()
        };
        assert_eq!(refused(too_slow), "period");
        let no_keys = RateLimitConfig {
            max_keys: 0,
            ..base()
        };
        assert_eq!(
            no_keys.build_keyed::<u32>("r").unwrap_err().field,
            "max_keys"
        );
    }

    #[test]
    fn defaults_are_documented_values() {
        let config = RateLimitConfig::default();
        assert_eq!(
            (config.rate, config.period, config.burst),
            (100, Duration::from_secs(1), None)
        );
        assert_eq!(config.max_keys, 100_000);
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(
            serde_json::from_str::<RateLimitConfig>(&json).unwrap(),
            config
        );
        assert!(serde_json::from_str::<RateLimitConfig>(r#"{"rates": 1}"#).is_err());
    }
}
