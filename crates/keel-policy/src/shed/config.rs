//! The bounds of queues and load shedding, derived from a latency target.

use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::{BoundedQueue, LoadShed};
use crate::ConfigError;

/// How many items fit in `target` of queueing when `servers` work in
/// parallel and each item takes `service_time`: Little's law,
/// `target × servers / service_time`.
fn bound_for(target: Duration, service_time: Duration, servers: usize) -> usize {
    let per_server = target.as_nanos() / service_time.as_nanos().max(1);
    usize::try_from(per_server.saturating_mul(servers as u128)).unwrap_or(usize::MAX)
}

fn check_latency(target: Duration, service_time: Duration) -> Result<(), ConfigError> {
    ConfigError::ensure(
        target > Duration::ZERO,
        "latency_target",
        "must be positive",
    )?;
    ConfigError::ensure(
        service_time > Duration::ZERO,
        "service_time",
        "must be positive",
    )
}

fn check_retry_after(retry_after: Duration) -> Result<(), ConfigError> {
    ConfigError::ensure(
        retry_after > Duration::ZERO,
        "retry_after",
        "must be positive",
    )
}

/// The serde form of a [`BoundedQueue`]'s settings.
///
/// The capacity is chosen from a *latency* target, not from memory: with
/// the defaults, 640 ms of queueing at 10 ms per item and one consumer is
/// 64 items.
///
/// ```
/// let config = keel_policy::shed::QueueConfig::default();
/// assert_eq!(config.capacity(), Ok(64));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// The most queueing delay an item should see. Default 640 ms.
    #[serde(with = "humantime_serde")]
    pub latency_target: Duration,
    /// How long a consumer takes per item. Default 10 ms.
    #[serde(with = "humantime_serde")]
    pub service_time: Duration,
    /// How many consumers work in parallel. Default 1.
    pub consumers: usize,
    /// Sets the capacity directly instead of deriving it. Default none.
    pub capacity: Option<usize>,
    /// The `retry_after` of a refused `try_put`. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            latency_target: Duration::from_millis(640),
            service_time: Duration::from_millis(10),
            consumers: 1,
            capacity: None,
            retry_after: Duration::from_secs(1),
        }
    }
}

impl QueueConfig {
    /// The capacity these settings give, or the setting that cannot work.
    pub fn capacity(&self) -> Result<usize, ConfigError> {
        check_retry_after(self.retry_after)?;
        let capacity = match self.capacity {
            Some(capacity) => capacity,
            None => {
                check_latency(self.latency_target, self.service_time)?;
                ConfigError::ensure(self.consumers > 0, "consumers", "must be at least 1")?;
                bound_for(self.latency_target, self.service_time, self.consumers)
            }
        };
        ConfigError::ensure(
            capacity > 0,
            "capacity",
            "is zero: the latency target is shorter than one item's service time",
        )?;
        ConfigError::ensure(
            capacity <= Semaphore::MAX_PERMITS,
            "capacity",
            "exceeds the largest supported bound (usize::MAX >> 3)",
        )?;
        Ok(capacity)
    }

    /// Builds a [`BoundedQueue`] named `name`.
    pub fn build<T>(self, name: impl Into<Name>) -> Result<BoundedQueue<T>, ConfigError> {
        let capacity = self.capacity()?;
        Ok(BoundedQueue::new(name.into(), capacity, self.retry_after))
    }
}

/// Builds a [`BoundedQueue`]; see [`QueueConfig`] for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct QueueBuilder {
    name: Name,
    config: QueueConfig,
}

impl QueueBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: QueueConfig::default(),
        }
    }

    /// Sizes the queue for `target` of queueing at `service_time` per item
    /// (default 640 ms at 10 ms: 64 items).
    pub fn latency_target(mut self, target: Duration, service_time: Duration) -> Self {
        self.config.latency_target = target;
        self.config.service_time = service_time;
        self
    }

    /// How many consumers work in parallel (default 1).
    pub fn consumers(mut self, consumers: usize) -> Self {
        self.config.consumers = consumers;
        self
    }

    /// Sets the capacity directly instead of deriving it.
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.config.capacity = Some(capacity);
        self
    }

    /// The `retry_after` of a refused `try_put` (default 1 s).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.config.retry_after = retry_after;
        self
    }

    /// Builds the queue, or says which setting cannot work.
    pub fn build<T>(self) -> Result<BoundedQueue<T>, ConfigError> {
        self.config.build(self.name)
    }
}

/// The serde form of a [`LoadShed`] policy's settings.
///
/// The queue behind the in-flight limit is derived from the latency target:
/// with `max_in_flight` calls in parallel taking `service_time` each, a
/// queued call waits about `queued × service_time / max_in_flight`, so the
/// defaults (64 in flight, 10 ms, 100 ms) allow 640 queued calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadShedConfig {
    /// How many calls may run at once. Default 64.
    pub max_in_flight: usize,
    /// The most time a call should spend queued; also the longest it may
    /// wait. Default 100 ms.
    #[serde(with = "humantime_serde")]
    pub latency_target: Duration,
    /// How long a call usually takes. Default 10 ms.
    #[serde(with = "humantime_serde")]
    pub service_time: Duration,
    /// Sets the queue bound directly instead of deriving it (0: no queue).
    /// Default none.
    pub max_queued: Option<usize>,
    /// The `retry_after` of a shed call. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
}

impl Default for LoadShedConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 64,
            latency_target: Duration::from_millis(100),
            service_time: Duration::from_millis(10),
            max_queued: None,
            retry_after: Duration::from_secs(1),
        }
    }
}

impl LoadShedConfig {
    /// How many calls may queue, or the setting that cannot work.
    pub fn max_queued(&self) -> Result<usize, ConfigError> {
        ConfigError::ensure(
            self.max_in_flight > 0,
            "max_in_flight",
            "must be at least 1",
        )?;
        ConfigError::ensure(
            self.max_in_flight <= Semaphore::MAX_PERMITS,
            "max_in_flight",
            "exceeds the largest supported limit (usize::MAX >> 3)",
        )?;
        check_latency(self.latency_target, self.service_time)?;
        check_retry_after(self.retry_after)?;
        Ok(self.max_queued.unwrap_or_else(|| {
            bound_for(self.latency_target, self.service_time, self.max_in_flight)
        }))
    }

    /// Builds a [`LoadShed`] policy named `name`.
    pub fn build(self, name: impl Into<Name>) -> Result<LoadShed, ConfigError> {
        let max_queued = self.max_queued()?;
        Ok(LoadShed::new(name.into(), &self, max_queued))
    }
}

/// Builds a [`LoadShed`] policy; see [`LoadShedConfig`] for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct LoadShedBuilder {
    name: Name,
    config: LoadShedConfig,
}

impl LoadShedBuilder {
    pub(super) fn new(name: Name) -> Self {
        Self {
            name,
            config: LoadShedConfig::default(),
        }
    }

    /// How many calls may run at once (default 64).
    pub fn max_in_flight(mut self, max: usize) -> Self {
        self.config.max_in_flight = max;
        self
    }

    /// The queueing budget and the usual call duration the queue bound is
    /// derived from (default 100 ms and 10 ms).
    pub fn latency_target(mut self, target: Duration, service_time: Duration) -> Self {
        self.config.latency_target = target;
        self.config.service_time = service_time;
        self
    }

    /// Sets the queue bound directly (0: shed as soon as all slots are
    /// taken).
    pub fn max_queued(mut self, max: usize) -> Self {
        self.config.max_queued = Some(max);
        self
    }

    /// The `retry_after` of a shed call (default 1 s).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.config.retry_after = retry_after;
        self
    }

    /// Builds the policy, or says which setting cannot work.
    pub fn build(self) -> Result<LoadShed, ConfigError> {
        self.config.build(self.name)
    }
}
