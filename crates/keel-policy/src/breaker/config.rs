//! The breaker's settings: serde form, builder, and the one validation path.

use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::CircuitBreaker;
use crate::ConfigError;

/// The largest count-based window, in calls (one byte of memory per call).
pub const MAX_WINDOW_CALLS: u32 = 1_000_000;
/// The largest time-based window, in seconds (one bucket per second).
pub const MAX_WINDOW_SECONDS: u32 = 3_600;

/// Which recent calls the failure rate and the slow-call rate are computed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SlidingWindow {
    /// The last `size` calls. Recording takes no lock.
    Count {
        /// How many calls the window holds (1 to [`MAX_WINDOW_CALLS`]).
        size: u32,
    },
    /// The calls of the last `seconds` seconds, aggregated per second.
    /// Suits bursty traffic; recording takes a short uncontended lock.
    Time {
        /// How many seconds the window spans (1 to [`MAX_WINDOW_SECONDS`]).
        seconds: u32,
    },
    /// No window: rates are never evaluated, and only
    /// [`consecutive_failures`](CircuitBreakerConfig::consecutive_failures)
    /// can open the breaker.
    Off,
}

impl Default for SlidingWindow {
    fn default() -> Self {
        Self::Count { size: 100 }
    }
}

/// A circuit breaker's configuration, as read from a file.
///
/// Every field has a default (see [`Default`]), so a file names only what it
/// changes. Rates are percentages in `(0, 100]`; durations are humantime
/// strings (`"30s"`, `"5m"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitBreakerConfig {
    /// Open when at least this percentage of the window's calls failed.
    /// Default 50.
    pub failure_rate_threshold: f64,
    /// Open when at least this percentage of the window's calls were slow.
    /// Default 100 (only an entirely slow window opens the breaker).
    pub slow_call_rate_threshold: f64,
    /// A call taking at least this long is slow. Default unset: durations
    /// are not measured and no clock is read on the happy path.
    #[serde(with = "humantime_serde")]
    pub slow_call_duration_threshold: Option<Duration>,
    /// Which calls the rates cover. Default: the last 100 calls.
    pub sliding_window: SlidingWindow,
    /// No rate is evaluated before the window holds this many calls.
    /// Default 20.
    pub minimum_calls: u32,
    /// Also open after this many failures in a row, whatever the rates.
    /// Default unset.
    pub consecutive_failures: Option<u32>,
    /// How many probe calls half-open lets through; all must succeed to
    /// close. Default 1.
    pub permitted_calls_in_half_open: u32,
    /// How long the breaker stays open the first time. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub open_duration: Duration,
    /// The open duration doubles each time a probe fails, up to this.
    /// Default 5 min.
    #[serde(with = "humantime_serde")]
    pub max_open_duration: Duration,
    /// Each open duration is spread by up to ± this fraction, so that a
    /// fleet of breakers does not probe in lockstep. Default 0.1.
    pub open_duration_jitter: f64,
    /// If the probes have not all answered within this time, the breaker
    /// counts that as a failed probe and opens again. Default unset (wait
    /// for the probes; put a timeout inside the breaker).
    #[serde(with = "humantime_serde")]
    pub max_wait_in_half_open: Option<Duration>,
    /// Seeds the jitter for reproducible tests. Default unset (random).
    pub seed: Option<u64>,
}

impl Default for CircuitBreakerConfig {
    fn default() -> Self {
        Self {
            failure_rate_threshold: 50.0,
            slow_call_rate_threshold: 100.0,
            slow_call_duration_threshold: None,
            sliding_window: SlidingWindow::default(),
            minimum_calls: 20,
            consecutive_failures: None,
            permitted_calls_in_half_open: 1,
            open_duration: Duration::from_secs(30),
            max_open_duration: Duration::from_secs(300),
            open_duration_jitter: 0.1,
            max_wait_in_half_open: None,
            seed: None,
        }
    }
}

impl CircuitBreakerConfig {
    /// Builds a breaker named `name` from this configuration.
    pub fn build(self, name: impl Into<Name>) -> Result<CircuitBreaker, ConfigError> {
        self.validate()?;
        Ok(CircuitBreaker::from_valid(self, name.into()))
    }

    /// Checks every field, naming the first one that cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        percentage(self.failure_rate_threshold, "failure_rate_threshold")?;
        percentage(self.slow_call_rate_threshold, "slow_call_rate_threshold")?;
        positive_if_set(
            self.slow_call_duration_threshold,
            "slow_call_duration_threshold",
        )?;
        self.validate_window()?;
        ConfigError::ensure(
            self.minimum_calls >= 1,
            "minimum_calls",
            "must be at least 1",
        )?;
        ConfigError::ensure(
            self.consecutive_failures != Some(0),
            "consecutive_failures",
            "must be at least 1; leave it unset to not count failures in a row",
        )?;
        ConfigError::ensure(
            (1..=u32::from(u16::MAX)).contains(&self.permitted_calls_in_half_open),
            "permitted_calls_in_half_open",
            "must be between 1 and 65535",
        )?;
        self.validate_open_durations()
    }

    fn validate_window(&self) -> Result<(), ConfigError> {
        match self.sliding_window {
            SlidingWindow::Count { size } => {
                ConfigError::ensure(
                    (1..=MAX_WINDOW_CALLS).contains(&size),
                    "sliding_window.size",
                    "must be between 1 and 1000000 calls",
                )?;
                ConfigError::ensure(
                    self.minimum_calls <= size,
                    "minimum_calls",
                    "exceeds the sliding window's size, so the breaker could never open",
                )
            }
            SlidingWindow::Time { seconds } => ConfigError::ensure(
                (1..=MAX_WINDOW_SECONDS).contains(&seconds),
                "sliding_window.seconds",
                "must be between 1 and 3600 seconds",
            ),
            SlidingWindow::Off => ConfigError::ensure(
                self.consecutive_failures.is_some(),
                "sliding_window",
                "is off and consecutive_failures is unset, so nothing could open the breaker",
            ),
        }
    }

    fn validate_open_durations(&self) -> Result<(), ConfigError> {
        ConfigError::ensure(
            !self.open_duration.is_zero(),
            "open_duration",
            "must be greater than zero",
        )?;
        ConfigError::ensure(
            self.max_open_duration >= self.open_duration,
            "max_open_duration",
            "must be at least open_duration",
        )?;
        ConfigError::ensure(
            (0.0..1.0).contains(&self.open_duration_jitter),
            "open_duration_jitter",
            "must be a fraction in [0, 1)",
        )?;
        positive_if_set(self.max_wait_in_half_open, "max_wait_in_half_open")
    }
}

fn percentage(value: f64, field: &'static str) -> Result<(), ConfigError> {
    ConfigError::ensure(
        value > 0.0 && value <= 100.0,
        field,
        "must be a percentage in (0, 100]",
    )
}

fn positive_if_set(value: Option<Duration>, field: &'static str) -> Result<(), ConfigError> {
    ConfigError::ensure(
        value.is_none_or(|d| !d.is_zero()),
        field,
        "must be greater than zero when set",
    )
}

/// Builds a [`CircuitBreaker`]; every setting starts at the default
/// documented on [`CircuitBreakerConfig`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct CircuitBreakerBuilder {
    name: Name,
    config: CircuitBreakerConfig,
}

impl CircuitBreakerBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: CircuitBreakerConfig::default(),
        }
    }

    /// Starts from `config` instead of the defaults.
    pub fn config(mut self, config: CircuitBreakerConfig) -> Self {
        self.config = config;
        self
    }

    /// Percentage of failed calls at which the breaker opens (default 50).
    pub fn failure_rate_threshold(mut self, percent: f64) -> Self {
        self.config.failure_rate_threshold = percent;
        self
    }

    /// Percentage of slow calls at which the breaker opens (default 100).
    pub fn slow_call_rate_threshold(mut self, percent: f64) -> Self {
        self.config.slow_call_rate_threshold = percent;
        self
    }

    /// Calls taking at least `duration` count as slow (default: not measured).
    pub fn slow_call_duration_threshold(mut self, duration: Duration) -> Self {
        self.config.slow_call_duration_threshold = Some(duration);
        self
    }

    /// Which calls the rates cover (default: the last 100 calls).
    pub fn sliding_window(mut self, window: SlidingWindow) -> Self {
        self.config.sliding_window = window;
        self
    }

    /// Rates cover the last `size` calls.
    pub fn count_window(self, size: u32) -> Self {
        self.sliding_window(SlidingWindow::Count { size })
    }

    /// Rates cover the last `seconds` seconds.
    pub fn time_window(self, seconds: u32) -> Self {
        self.sliding_window(SlidingWindow::Time { seconds })
    }

    /// Calls recorded before any rate is evaluated (default 20).
    pub fn minimum_calls(mut self, calls: u32) -> Self {
        self.config.minimum_calls = calls;
        self
    }

    /// Also open after `failures` failures in a row (default: off).
    pub fn consecutive_failures(mut self, failures: u32) -> Self {
        self.config.consecutive_failures = Some(failures);
        self
    }

    /// Probe calls let through when half-open (default 1).
    pub fn permitted_calls_in_half_open(mut self, calls: u32) -> Self {
        self.config.permitted_calls_in_half_open = calls;
        self
    }

    /// The first open duration (default 30 s).
    pub fn open_duration(mut self, duration: Duration) -> Self {
        self.config.open_duration = duration;
        self
    }

    /// The cap of the doubling open duration (default 5 min).
    pub fn max_open_duration(mut self, duration: Duration) -> Self {
        self.config.max_open_duration = duration;
        self
    }

    /// Spread of each open duration, as a fraction (default 0.1; 0 for none).
    pub fn open_duration_jitter(mut self, fraction: f64) -> Self {
        self.config.open_duration_jitter = fraction;
        self
    }

    /// Give up on unanswered probes after `duration` (default: wait).
    pub fn max_wait_in_half_open(mut self, duration: Duration) -> Self {
        self.config.max_wait_in_half_open = Some(duration);
        self
    }

    /// Seeds the jitter, for reproducible tests.
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = Some(seed);
        self
    }

    /// Validates the settings and builds the breaker.
    pub fn build(self) -> Result<CircuitBreaker, ConfigError> {
        self.config.build(self.name)
    }
}
