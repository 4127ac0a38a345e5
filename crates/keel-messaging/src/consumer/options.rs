//! The consumer's knobs, with the reasoning behind each default.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use keel_policy::ConfigError;
use keel_policy::retry::Backoff;

/// The default most handlers running at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 16;
/// The default deliveries before a failing message is dead-lettered.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;
/// The default broker lease per delivery.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default longest wait in one receive call.
pub const DEFAULT_RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// The default time in-flight handlers get to finish at shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// The default time an inbox row is kept.
pub const DEFAULT_INBOX_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// The default time between inbox prunes.
pub const DEFAULT_INBOX_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// How a [`Consumer`](super::Consumer) behaves.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The most handlers running at once, across all groups (default 16).
    /// The consumer receives only as many messages as it has free slots:
    /// that is the backpressure. Unreceived messages wait in the broker,
    /// where they are durable and visible to other consumers.
    pub max_in_flight: NonZeroUsize,
    /// Deliveries after which a failing message is dead-lettered with its
    /// history (default 5).
    pub max_deliveries: NonZeroU32,
    /// The broker lease of each delivery (default 30 s). It is extended
    /// every [`lease_extend_every`](Self::lease_extend_every) while a
    /// handler runs, so it only needs to outlast a stalled *process*, not
    /// the slowest handler.
    pub lease: Duration,
    /// How often a running handler's lease is extended (default: a third of
    /// the lease, so two extensions can fail before it expires).
    pub lease_extend_every: Option<Duration>,
    /// The longest a receive call waits for a first message (default 1 s);
    /// also the longest shutdown waits for a receive in progress.
    pub receive_wait: Duration,
    /// How long in-flight handlers may run on at shutdown before they are
    /// cancelled and their messages released (default 30 s, which fits a
    /// 45 s Kubernetes grace period after a 15 s preStop).
    pub drain_timeout: Duration,
    /// The redelivery delays after retryable failures, by delivery count
    /// (default: 200 ms doubling to 10 s, full jitter).
    pub backoff: Backoff,
    /// How long inbox rows are kept before the consumer prunes them
    /// (default 7 days; `None` never prunes). A row only has to outlive
    /// redeliveries of its event to this group: lost acks (a lease), relay
    /// republishes (a lease) and broker redelivery (minutes). Dead-letter
    /// replays do not depend on it (they target the group that never applied
    /// the event).
    pub inbox_retention: Option<Duration>,
    /// The time between inbox prunes (default 1 h).
    pub inbox_prune_interval: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            max_in_flight: NonZeroUsize::new(DEFAULT_MAX_IN_FLIGHT).unwrap_or(NonZeroUsize::MIN),
            max_deliveries: NonZeroU32::new(DEFAULT_MAX_DELIVERIES).unwrap_or(NonZeroU32::MIN),
            lease: DEFAULT_LEASE,
            lease_extend_every: None,
            receive_wait: DEFAULT_RECEIVE_WAIT,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            backoff: Backoff::default(),
            inbox_retention: Some(DEFAULT_INBOX_RETENTION),
            inbox_prune_interval: DEFAULT_INBOX_PRUNE_INTERVAL,
        }
    }
}

impl ConsumerOptions {
    /// The interval between lease extensions.
    pub fn extend_every(&self) -> Duration {
        self.lease_extend_every.unwrap_or(self.lease / 3)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.lease.is_zero() {
            return Err(ConfigError::new("lease", "must be greater than zero"));
        }
        let every = self.extend_every();
        if every.is_zero() || every >= self.lease {
            return Err(ConfigError::new(
                "lease_extend_every",
                "must be greater than zero and shorter than the lease (a third of it is usual)",
            ));
        }
        if self.inbox_prune_interval.is_zero() {
            return Err(ConfigError::new(
                "inbox_prune_interval",
                "must be greater than zero",
            ));
        }
        if self.receive_wait.is_zero() {
            return Err(ConfigError::new(
                "receive_wait",
                "must be greater than zero, or receiving would spin",
            ));
        }
        Ok(())
    }
}
