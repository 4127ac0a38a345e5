//! The bulkhead's settings, as a builder and as a serde form.

use std::hash::Hash;
use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{Bulkhead, KeyedBulkhead};
use crate::ConfigError;

/// The serde form of a [`Bulkhead`]'s settings; every field has the default
/// documented on it.
///
/// ```
/// let config: keel_policy::bulkhead::BulkheadConfig =
///     serde_json::from_str(r#"{ "max_concurrent": 4, "max_waiting": 8, "max_wait": "50ms" }"#)
///         .unwrap();
/// let bulkhead = config.build("payments").unwrap();
/// assert_eq!(bulkhead.stats().available, 4);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BulkheadConfig {
    /// How many calls may run at once. Default 10.
    pub max_concurrent: usize,
    /// How many calls may wait for a free slot when all are taken. Default 0:
    /// a full bulkhead refuses at once, so callers fail fast instead of
    /// piling up behind a slow dependency.
    pub max_waiting: usize,
    /// How long a waiting call may wait before it is refused (never longer
    /// than the current [`Deadline`](keel_core::Deadline)). Default 100 ms.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// [`KeyedBulkhead`] only: how many keys are tracked at most. Default
    /// 10 000. Beyond it, new keys share one overflow compartment.
    pub max_keys: usize,
}

impl Default for BulkheadConfig {
    fn default() -> Self {
        Self {
            max_concurrent: 10,
            max_waiting: 0,
            max_wait: Duration::from_millis(100),
            max_keys: 10_000,
        }
    }
}

impl BulkheadConfig {
    /// Builds a [`Bulkhead`] named `name`, or says which setting cannot work.
    pub fn build(self, name: impl Into<Name>) -> Result<Bulkhead, ConfigError> {
        self.validate()?;
        Ok(Bulkhead::from_config(name.into(), &self))
    }

    /// Builds a [`KeyedBulkhead`]: one compartment with these limits per key.
    pub fn build_keyed<K: Hash + Eq + Clone>(
        self,
        name: impl Into<Name>,
    ) -> Result<KeyedBulkhead<K>, ConfigError> {
        self.validate()?;
        Ok(KeyedBulkhead::from_config(name.into(), &self))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::ensure(
            self.max_concurrent > 0,
            "max_concurrent",
            "must be at least 1",
        )?;
        ConfigError::ensure(
            self.max_wait > Duration::ZERO,
            "max_wait",
            "must be positive; use `max_waiting = 0` to refuse without waiting",
        )?;
        ConfigError::ensure(self.max_keys > 0, "max_keys", "must be at least 1")
    }
}

/// Builds a [`Bulkhead`] or a [`KeyedBulkhead`]; see [`BulkheadConfig`] for
/// the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct BulkheadBuilder {
    name: Name,
    config: BulkheadConfig,
}

impl BulkheadBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: BulkheadConfig::default(),
        }
    }

    /// How many calls may run at once (default 10).
    pub fn max_concurrent(mut self, max: usize) -> Self {
        self.config.max_concurrent = max;
        self
    }

    /// How many calls may wait for a slot (default 0: refuse at once).
    pub fn max_waiting(mut self, max: usize) -> Self {
        self.config.max_waiting = max;
        self
    }

    /// How long a call may wait for a slot (default 100 ms).
    pub fn max_wait(mut self, max: Duration) -> Self {
        self.config.max_wait = max;
        self
    }

    /// How many keys a keyed bulkhead tracks (default 10 000).
    pub fn max_keys(mut self, max: usize) -> Self {
        self.config.max_keys = max;
        self
    }

    /// Builds the bulkhead, or says which setting cannot work.
    pub fn build(self) -> Result<Bulkhead, ConfigError> {
        self.config.build(self.name)
    }

    /// Builds a bulkhead with one compartment per key.
    pub fn build_keyed<K: Hash + Eq + Clone>(self) -> Result<KeyedBulkhead<K>, ConfigError> {
        self.config.build_keyed(self.name)
    }
}
