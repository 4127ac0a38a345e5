//! The settings of a [`Balancer`], their defaults and their validation.

use std::sync::Arc;
use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{Balancer, Shared};
use crate::ConfigError;

/// How an endpoint's load is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Strategy {
    /// Peak-EWMA latency times (requests in flight + 1).
    #[default]
    PeakEwma,
    /// Requests in flight (`LEAST_REQUEST`).
    LeastRequest,
}

/// The configuration of a [`Balancer`], as read from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalanceConfig {
    /// How load is measured (default [`Strategy::PeakEwma`]).
    pub strategy: Strategy,
    /// The latency assumed for an endpoint before it has answered (default
    /// 30 ms). Must be more than zero: a new endpoint must not look free.
    #[serde(with = "humantime_serde")]
    pub default_rtt: Duration,
    /// How fast the latency estimate forgets (default 10 s). Must be more
    /// than zero.
    #[serde(with = "humantime_serde")]
    pub decay: Duration,
    /// Dependency failures in a row that eject an endpoint (default 5).
    /// At least 1.
    pub consecutive_failures: u32,
    /// Time in the pool that forgives one past ejection (default 10 s). Must
    /// be more than zero.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// How long a first ejection lasts; it grows with each repeat (default
    /// 30 s). Must be more than zero.
    #[serde(with = "humantime_serde")]
    pub base_ejection_time: Duration,
    /// The longest an ejection lasts (default 300 s). At least
    /// `base_ejection_time`.
    #[serde(with = "humantime_serde")]
    pub max_ejection_time: Duration,
    /// The share of endpoints that may be ejected at once, in percent
    /// (default 50). Below 100; 0 turns ejection off.
    pub max_ejection_percent: u8,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::PeakEwma,
            default_rtt: Duration::from_millis(30),
            decay: Duration::from_secs(10),
            consecutive_failures: 5,
            interval: Duration::from_secs(10),
            base_ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 50,
        }
    }
}

impl BalanceConfig {
    /// Validates the configuration and builds an empty balancer.
    pub fn build<E>(self, name: impl Into<Name>) -> Result<Balancer<E>, ConfigError> {
        self.build_seeded(name.into(), None)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = "must be more than zero";
        ConfigError::ensure(!self.default_rtt.is_zero(), "default_rtt", positive)?;
        ConfigError::ensure(!self.decay.is_zero(), "decay", positive)?;
        ConfigError::ensure(!self.interval.is_zero(), "interval", positive)?;
        ConfigError::ensure(
            !self.base_ejection_time.is_zero(),
            "base_ejection_time",
            positive,
        )?;
        ConfigError::ensure(
            self.consecutive_failures >= 1,
            "consecutive_failures",
            "must be at least 1",
        )?;
        ConfigError::ensure(
            self.max_ejection_time >= self.base_ejection_time,
            "max_ejection_time",
            "must be at least base_ejection_time",
        )?;
        ConfigError::ensure(
            self.max_ejection_percent < 100,
            "max_ejection_percent",
            "must be below 100: ejecting every endpoint turns a degraded dependency into a total outage",
        )
    }

    fn build_seeded<E>(self, name: Name, seed: Option<u64>) -> Result<Balancer<E>, ConfigError> {
        self.validate()?;
        Ok(Balancer {
            shared: Arc::new(Shared::new(name, self, seed)),
        })
    }
}

/// Builds a [`Balancer`]; see the setters for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct BalancerBuilder {
    name: Name,
    config: BalanceConfig,
    seed: Option<u64>,
}

impl BalancerBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: BalanceConfig::default(),
            seed: None,
        }
    }

    /// How load is measured (default [`Strategy::PeakEwma`]).
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.config.strategy = strategy;
        self
    }

    /// The latency assumed for a new endpoint (default 30 ms).
    pub fn default_rtt(mut self, rtt: Duration) -> Self {
        self.config.default_rtt = rtt;
        self
    }

    /// How fast the latency estimate forgets (default 10 s).
    pub fn decay(mut self, decay: Duration) -> Self {
        self.config.decay = decay;
        self
    }

    /// Dependency failures in a row that eject an endpoint (default 5).
    pub fn consecutive_failures(mut self, failures: u32) -> Self {
        self.config.consecutive_failures = failures;
        self
    }

    /// Time in the pool that forgives one past ejection (default 10 s).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.config.interval = interval;
        self
    }

    /// How long a first ejection lasts (default 30 s).
    pub fn base_ejection_time(mut self, time: Duration) -> Self {
        self.config.base_ejection_time = time;
        self
    }

    /// The longest an ejection lasts (default 300 s).
    pub fn max_ejection_time(mut self, time: Duration) -> Self {
        self.config.max_ejection_time = time;
        self
    }

    /// The share of endpoints that may be ejected at once, in percent
    /// (default 50, must be below 100).
    pub fn max_ejection_percent(mut self, percent: u8) -> Self {
        self.config.max_ejection_percent = percent;
        self
    }

    /// Makes the random choices reproducible (tests, simulations). Seeded
    /// balancers draw from one shared generator behind a lock; unseeded ones
    /// use a per-thread generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Validates the settings and builds an empty balancer.
    pub fn build<E>(self) -> Result<Balancer<E>, ConfigError> {
        self.config.build_seeded(self.name, self.seed)
    }

    /// Validates the settings and builds a balancer over `endpoints`.
    pub fn build_with<E>(
        self,
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<Balancer<E>, ConfigError> {
        let balancer = self.build()?;
        for endpoint in endpoints {
            balancer.insert(endpoint);
        }
        Ok(balancer)
    }
}
