//! How a [`Hedge`] is configured: when to hedge, how many, and the budget.

use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::Hedge;
use crate::ConfigError;
use crate::retry::{RetryBudget, RetryBudgetConfig};

const MAX_HEDGES: u32 = 16;
const MAX_WINDOW: u32 = 1_000_000;

/// When to start a hedge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum HedgeDelay {
    /// Always after the same delay.
    Fixed {
        /// The delay, greater than zero.
        #[serde(with = "humantime_serde")]
        delay: Duration,
    },
    /// After a percentile of recent successful latencies.
    Percentile {
        /// The percentile, in (0, 100] (default 95: hedge the slowest 5%).
        #[serde(default = "default_percentile")]
        percentile: f64,
        /// Successes needed before the percentile is trusted (default 50).
        #[serde(default = "default_min_samples")]
        min_samples: u32,
        /// How many recent successes the percentile is taken over (default 1000).
        #[serde(default = "default_window")]
        window: u32,
        /// The delay until `min_samples` successes were seen (default 100 ms).
        #[serde(with = "humantime_serde", default = "default_fallback")]
        fallback: Duration,
    },
}

fn default_percentile() -> f64 {
    95.0
}

fn default_min_samples() -> u32 {
    50
}

fn default_window() -> u32 {
    1000
}

fn default_fallback() -> Duration {
    Duration::from_millis(100)
}

impl Default for HedgeDelay {
    /// p95 of the last 1000 successes, after 50; 100 ms before.
    fn default() -> Self {
        Self::percentile(default_percentile())
    }
}

impl HedgeDelay {
    /// Always hedge after `delay`.
    pub fn fixed(delay: Duration) -> Self {
        Self::Fixed { delay }
    }

    /// Hedge after `percentile` (in (0, 100]) of recent successful latencies,
    /// with the other settings at their defaults.
    pub fn percentile(percentile: f64) -> Self {
        Self::Percentile {
            percentile,
            min_samples: default_min_samples(),
            window: default_window(),
            fallback: default_fallback(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Self::Fixed { delay } => ConfigError::ensure(
                !delay.is_zero(),
                "delay",
                "must be greater than zero (a zero delay duplicates every call)",
            ),
            Self::Percentile {
                percentile,
                min_samples,
                window,
                fallback,
            } => {
                ConfigError::ensure(
                    percentile.is_finite() && *percentile > 0.0 && *percentile <= 100.0,
                    "percentile",
                    "must be in (0, 100], e.g. 95 for p95",
                )?;
                ConfigError::ensure(*min_samples >= 1, "min_samples", "must be at least 1")?;
                ConfigError::ensure(
                    *window >= *min_samples && *window <= MAX_WINDOW,
                    "window",
                    "must be at least `min_samples` and at most 1,000,000",
                )?;
                ConfigError::ensure(!fallback.is_zero(), "fallback", "must be greater than zero")
            }
        }
    }
}

/// The serde form of a [`Hedge`]; `Default` is the documented defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HedgeConfig {
    /// When to hedge (default: p95 of recent successes, 100 ms until 50 were seen).
    pub delay: HedgeDelay,
    /// Attempts started besides the first, 1 to 16 (default 1).
    pub max_hedged_attempts: u32,
    /// The budget hedges spend, one per `Hedge` (default
    /// [`RetryBudgetConfig::default`]); `null` for none.
    pub budget: Option<RetryBudgetConfig>,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        Self {
            delay: HedgeDelay::default(),
            max_hedged_attempts: 1,
            budget: Some(RetryBudgetConfig::default()),
        }
    }
}

impl HedgeConfig {
    /// Validates and builds the policy.
    pub fn build(self, name: impl Into<Name>) -> Result<Hedge, ConfigError> {
        Hedge::from_parts(name.into(), self, None)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.delay.validate()?;
        ConfigError::ensure(
            (1..=MAX_HEDGES).contains(&self.max_hedged_attempts),
            "max_hedged_attempts",
            "must be between 1 and 16 (more multiplies load without shortening the tail)",
        )
    }
}

/// Builds a [`Hedge`]; see [`HedgeConfig`] for the defaults.
#[derive(Debug)]
pub struct HedgeBuilder {
    name: Name,
    config: HedgeConfig,
    budget: Option<RetryBudget>,
}

impl HedgeBuilder {
    /// When to hedge (default: p95 of recent successes).
    pub fn delay(mut self, delay: HedgeDelay) -> Self {
        self.config.delay = delay;
        self
    }

    /// Attempts started besides the first (default 1).
    pub fn max_hedged_attempts(mut self, hedges: u32) -> Self {
        self.config.max_hedged_attempts = hedges;
        self
    }

    /// Shares an existing budget (e.g. with the dependency's [`Retry`](crate::retry::Retry)).
    /// Each policy deposits once per call, so a call that goes through both
    /// earns twice: halve the shared budget's ratio to keep the same bound.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// The configuration of this policy's own budget; `None` hedges without one.
    pub fn budget_config(mut self, budget: Option<RetryBudgetConfig>) -> Self {
        self.config.budget = budget;
        self.budget = None;
        self
    }

    /// Validates and builds the policy.
    pub fn build(self) -> Result<Hedge, ConfigError> {
        Hedge::from_parts(self.name, self.config, self.budget)
    }
}

impl Hedge {
    /// A builder with the documented defaults.
    pub fn builder(name: impl Into<Name>) -> HedgeBuilder {
        HedgeBuilder {
            name: name.into(),
            config: HedgeConfig::default(),
            budget: None,
        }
    }
}
