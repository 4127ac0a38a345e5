//! The rate limiter's settings, as a builder and as a serde form.

use std::hash::Hash;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::Quota;
use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{KeyedRateLimiter, RateLimiter};
use crate::ConfigError;

/// The longest time a full burst may take to refill; beyond it governor's
/// nanosecond arithmetic could overflow.
const MAX_REFILL: Duration = Duration::from_secs(10 * 365 * 86_400);

/// The serde form of a rate limit: `rate` calls per `period`, with bursts of
/// up to `burst` calls.
///
/// ```
/// let config: keel_policy::rate_limit::RateLimitConfig =
///     serde_json::from_str(r#"{ "rate": 10, "period": "1s", "burst": 20 }"#).unwrap();
/// let limiter = config.build("search").unwrap();
/// assert!(limiter.check().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitConfig {
    /// How many calls are allowed per `period`. Default 100.
    pub rate: u32,
    /// The period `rate` is counted over. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub period: Duration,
    /// How many calls may arrive at once after a quiet spell. Default
    /// `rate`: a full period's worth.
    pub burst: Option<u32>,
    /// [`KeyedRateLimiter`] only: how many keys are tracked at most.
    /// Default 100 000. Beyond it, new keys share one overflow limit.
    pub max_keys: usize,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        Self {
            rate: 100,
            period: Duration::from_secs(1),
            burst: None,
            max_keys: 100_000,
        }
    }
}

impl RateLimitConfig {
    /// Builds a [`RateLimiter`] named `name`, or says which setting cannot
    /// work. Build it inside the tokio runtime whose clock it should follow.
    pub fn build(self, name: impl Into<Name>) -> Result<RateLimiter, ConfigError> {
        Ok(RateLimiter::new(name.into(), self.quota()?))
    }

    /// Builds a [`KeyedRateLimiter`]: one limit per key.
    pub fn build_keyed<K: Hash + Eq + Clone>(
        self,
        name: impl Into<Name>,
    ) -> Result<KeyedRateLimiter<K>, ConfigError> {
        let quota = self.quota()?;
        ConfigError::ensure(self.max_keys > 0, "max_keys", "must be at least 1")?;
        Ok(KeyedRateLimiter::new(name.into(), quota, self.max_keys))
    }

    fn quota(&self) -> Result<Quota, ConfigError> {
        let rate =
            NonZeroU32::new(self.rate).ok_or(ConfigError::new("rate", "must be at least 1"))?;
        ConfigError::ensure(self.period > Duration::ZERO, "period", "must be positive")?;
        let burst = match self.burst {
            None => rate,
            Some(burst) => {
                NonZeroU32::new(burst).ok_or(ConfigError::new("burst", "must be at least 1"))?
            }
        };
        let interval = self.period / rate.get();
        ConfigError::ensure(
            interval
                .checked_mul(burst.get())
                .is_some_and(|refill| refill <= MAX_REFILL),
            "period",
            "is too long: a full burst must refill within 10 years",
        )?;
        let quota = Quota::with_period(interval).ok_or(ConfigError::new(
            "rate",
            "is more than one call per nanosecond of `period`",
        ))?;
        Ok(quota.allow_burst(burst))
    }
}

/// Builds a [`RateLimiter`] or a [`KeyedRateLimiter`]; see
/// [`RateLimitConfig`] for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct RateLimitBuilder {
    name: Name,
    config: RateLimitConfig,
}

impl RateLimitBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: RateLimitConfig::default(),
        }
    }

    /// Allows `rate` calls per `period` (default 100 per second).
    pub fn rate(mut self, rate: u32, period: Duration) -> Self {
        self.config.rate = rate;
        self.config.period = period;
        self
    }

    /// Allows bursts of up to `burst` calls (default: `rate`).
    pub fn burst(mut self, burst: u32) -> Self {
        self.config.burst = Some(burst);
        self
    }

    /// How many keys a keyed limiter tracks (default 100 000).
    pub fn max_keys(mut self, max: usize) -> Self {
        self.config.max_keys = max;
        self
    }

    /// Builds the limiter, or says which setting cannot work.
    pub fn build(self) -> Result<RateLimiter, ConfigError> {
        self.config.build(self.name)
    }

    /// Builds a limiter with one limit per key.
    pub fn build_keyed<K: Hash + Eq + Clone>(self) -> Result<KeyedRateLimiter<K>, ConfigError> {
        self.config.build_keyed(self.name)
    }
}
