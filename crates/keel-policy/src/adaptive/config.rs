//! The adaptive limit's settings, as a builder and as a serde form.

use std::fmt;
use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{AdaptiveLimit, Aimd, Gradient, LimitAlgorithm};
use crate::ConfigError;

/// The largest limit accepted; far beyond any real concurrency.
const MAX_LIMIT: usize = 1 << 32;

/// The serde form of an [`AdaptiveLimit`]'s settings.
///
/// ```
/// let config: keel_policy::adaptive::AdaptiveConfig = serde_json::from_str(
///     r#"{ "max_limit": 50, "timeout": "500ms", "algorithm": { "kind": "aimd", "backoff_ratio": 0.8 } }"#,
/// )
/// .unwrap();
/// assert_eq!(config.build("search").unwrap().limit(), 20);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveConfig {
    /// The limit to start from. Default 20.
    pub initial_limit: usize,
    /// The limit never goes below this. Default 1.
    pub min_limit: usize,
    /// The limit never goes above this. Default 200.
    pub max_limit: usize,
    /// A call that takes at least this long counts as dropped even if it
    /// succeeds. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// The `retry_after` of a refused call. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
    /// How the limit adapts. Default: [`GradientConfig`]'s defaults.
    pub algorithm: AlgorithmConfig,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            initial_limit: 20,
            min_limit: 1,
            max_limit: 200,
            timeout: Duration::from_secs(1),
            retry_after: Duration::from_secs(1),
            algorithm: AlgorithmConfig::default(),
        }
    }
}

/// Which algorithm adapts the limit, with its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AlgorithmConfig {
    /// Additive increase, multiplicative decrease ([`Aimd`]).
    Aimd(AimdConfig),
    /// Netflix's gradient algorithm ([`Gradient`]).
    Gradient(GradientConfig),
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self::Gradient(GradientConfig::default())
    }
}

/// The settings of [`Aimd`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AimdConfig {
    /// What a drop multiplies the limit by, in (0, 1). Default 0.9.
    pub backoff_ratio: f64,
}

impl Default for AimdConfig {
    fn default() -> Self {
        Self { backoff_ratio: 0.9 }
    }
}

/// The settings of [`Gradient`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradientConfig {
    /// How far each update moves towards its target, in (0, 1]. Default 0.2.
    pub smoothing: f64,
    /// How much longer than `min_rtt` a round trip may be before it counts
    /// as queueing, at least 1. Default 1.5.
    pub tolerance: f64,
    /// What a drop multiplies the limit by, in (0, 1). Default 0.9.
    pub backoff_ratio: f64,
    /// How long a `min_rtt` is trusted before it is measured afresh.
    /// Default 30 s.
    #[serde(with = "humantime_serde")]
    pub min_rtt_window: Duration,
}

impl Default for GradientConfig {
    fn default() -> Self {
        Self {
            smoothing: 0.2,
            tolerance: 1.5,
            backoff_ratio: 0.9,
            min_rtt_window: Duration::from_secs(30),
        }
    }
}

fn check_ratio(value: f64, field: &'static str) -> Result<(), ConfigError> {
    ConfigError::ensure(
        value > 0.0 && value < 1.0,
        field,
        "must be strictly between 0 and 1",
    )
}

impl AlgorithmConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Self::Aimd(aimd) => check_ratio(aimd.backoff_ratio, "backoff_ratio"),
            Self::Gradient(gradient) => {
                check_ratio(gradient.backoff_ratio, "backoff_ratio")?;
                ConfigError::ensure(
                    gradient.smoothing > 0.0 && gradient.smoothing <= 1.0,
                    "smoothing",
                    "must be in (0, 1]",
                )?;
                ConfigError::ensure(
                    gradient.tolerance >= 1.0 && gradient.tolerance.is_finite(),
                    "tolerance",
                    "must be a finite number of at least 1",
                )?;
                ConfigError::ensure(
                    gradient.min_rtt_window > Duration::ZERO,
                    "min_rtt_window",
                    "must be positive",
                )
            }
        }
    }

    fn algorithm(&self) -> Box<dyn LimitAlgorithm> {
        match self {
            Self::Aimd(aimd) => Box::new(Aimd::new(aimd)),
            Self::Gradient(gradient) => Box::new(Gradient::new(gradient)),
        }
    }
}

impl AdaptiveConfig {
    /// Builds an [`AdaptiveLimit`] named `name`, or says which setting
    /// cannot work.
    pub fn build(self, name: impl Into<Name>) -> Result<AdaptiveLimit, ConfigError> {
        self.validate()?;
        let algorithm = self.algorithm.algorithm();
        Ok(AdaptiveLimit::new(name.into(), &self, algorithm))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::ensure(self.min_limit >= 1, "min_limit", "must be at least 1")?;
        ConfigError::ensure(
            self.max_limit >= self.min_limit && self.max_limit <= MAX_LIMIT,
            "max_limit",
            "must be at least `min_limit` and at most 2^32",
        )?;
        ConfigError::ensure(
            (self.min_limit..=self.max_limit).contains(&self.initial_limit),
            "initial_limit",
            "must be between `min_limit` and `max_limit`",
        )?;
        ConfigError::ensure(self.timeout > Duration::ZERO, "timeout", "must be positive")?;
        ConfigError::ensure(
            self.retry_after > Duration::ZERO,
            "retry_after",
            "must be positive",
        )?;
        self.algorithm.validate()
    }
}

/// Builds an [`AdaptiveLimit`]; see [`AdaptiveConfig`] for the defaults.
#[must_use]
pub struct AdaptiveBuilder {
    name: Name,
    config: AdaptiveConfig,
    custom: Option<Box<dyn LimitAlgorithm>>,
}

impl AdaptiveBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: AdaptiveConfig::default(),
            custom: None,
        }
    }

    /// The initial, least and greatest limit (default 20, 1, 200).
    pub fn limits(mut self, initial: usize, min: usize, max: usize) -> Self {
        self.config.initial_limit = initial;
        self.config.min_limit = min;
        self.config.max_limit = max;
        self
    }

    /// A call at least this slow counts as dropped (default 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// The `retry_after` of a refused call (default 1 s).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.config.retry_after = retry_after;
        self
    }

    /// Adapts with [`Aimd`].
    pub fn aimd(mut self, config: AimdConfig) -> Self {
        self.config.algorithm = AlgorithmConfig::Aimd(config);
        self.custom = None;
        self
    }

    /// Adapts with [`Gradient`] (the default).
    pub fn gradient(mut self, config: GradientConfig) -> Self {
        self.config.algorithm = AlgorithmConfig::Gradient(config);
        self.custom = None;
        self
    }

    /// Adapts with an algorithm of your own.
    pub fn algorithm(mut self, algorithm: impl LimitAlgorithm) -> Self {
        self.custom = Some(Box::new(algorithm));
        self
    }

    /// Builds the policy, or says which setting cannot work.
    pub fn build(self) -> Result<AdaptiveLimit, ConfigError> {
        match self.custom {
            None => self.config.build(self.name),
            Some(algorithm) => {
                self.config.validate()?;
                Ok(AdaptiveLimit::new(self.name, &self.config, algorithm))
            }
        }
    }
}

impl fmt::Debug for AdaptiveBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveBuilder")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("custom_algorithm", &self.custom.is_some())
            .finish()
    }
}
