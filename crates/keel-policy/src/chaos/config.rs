//! The settings of a [`FaultInjection`], and their validation.

use std::sync::Arc;
use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{FaultInjection, Inner};
use crate::ConfigError;

/// Added latency for a share of calls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayFault {
    /// The share of calls delayed, 0 to 100.
    pub percentage: f64,
    /// How long each delayed call waits before running. More than zero.
    #[serde(with = "humantime_serde")]
    pub fixed_delay: Duration,
}

/// Injected failures for a share of calls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortFault {
    /// The share of calls failed with [`Rejected::InjectedFault`](keel_core::Rejected::InjectedFault), 0 to 100.
    pub percentage: f64,
}

/// The configuration of a [`FaultInjection`], as read from a file. The
/// default injects nothing and is disabled.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultInjectionConfig {
    /// Whether faults are injected at all (default `false`).
    pub enabled: bool,
    /// Act only on calls in this experiment; without it, on calls in any
    /// experiment (never on calls outside one).
    pub experiment: Option<String>,
    /// Added latency (default none).
    pub delay: Option<DelayFault>,
    /// Injected failures (default none).
    pub abort: Option<AbortFault>,
}

impl FaultInjectionConfig {
    /// Validates the configuration and builds the injector.
    pub fn build(self, name: impl Into<Name>) -> Result<FaultInjection, ConfigError> {
        self.build_seeded(name.into(), None)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(delay) = self.delay {
            ensure_percentage(delay.percentage, "delay.percentage")?;
            ConfigError::ensure(
                !delay.fixed_delay.is_zero(),
                "delay.fixed_delay",
                "must be more than zero: a zero delay injects nothing",
            )?;
        }
        if let Some(abort) = self.abort {
            ensure_percentage(abort.percentage, "abort.percentage")?;
        }
        ConfigError::ensure(
            self.experiment.as_ref().is_none_or(|e| !e.is_empty()),
            "experiment",
            "must not be empty; leave it out to act on every experiment",
        )
    }

    fn build_seeded(self, name: Name, seed: Option<u64>) -> Result<FaultInjection, ConfigError> {
        self.validate()?;
        Ok(FaultInjection {
            inner: Arc::new(Inner::new(name, self, seed)),
        })
    }
}

fn ensure_percentage(value: f64, field: &'static str) -> Result<(), ConfigError> {
    ConfigError::ensure(
        value.is_finite() && (0.0..=100.0).contains(&value),
        field,
        "must be a percentage from 0 to 100",
    )
}

/// Builds a [`FaultInjection`]; by default it injects nothing and is off.
#[derive(Debug, Clone)]
#[must_use]
pub struct FaultInjectionBuilder {
    name: Name,
    config: FaultInjectionConfig,
    seed: Option<u64>,
}

impl FaultInjectionBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: FaultInjectionConfig::default(),
            seed: None,
        }
    }

    /// Delays `percentage` of calls (0 to 100) by `delay` before they run.
    pub fn delay(mut self, percentage: f64, delay: Duration) -> Self {
        self.config.delay = Some(DelayFault {
            percentage,
            fixed_delay: delay,
        });
        self
    }

    /// Fails `percentage` of calls (0 to 100) with [`Rejected::InjectedFault`](keel_core::Rejected::InjectedFault).
    pub fn abort(mut self, percentage: f64) -> Self {
        self.config.abort = Some(AbortFault { percentage });
        self
    }

    /// Acts only on calls in the experiment `name` (default: any experiment).
    pub fn experiment(mut self, name: impl Into<String>) -> Self {
        self.config.experiment = Some(name.into());
        self
    }

    /// Whether faults are injected (default `false`).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.config.enabled = enabled;
        self
    }

    /// Makes the random choices reproducible (tests). Seeded injectors draw
    /// from one generator behind a lock; unseeded ones use a per-thread one.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Validates the settings and builds the injector.
    pub fn build(self) -> Result<FaultInjection, ConfigError> {
        self.config.build_seeded(self.name, self.seed)
    }
}
