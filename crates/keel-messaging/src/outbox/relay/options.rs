//! How a relay behaves, and its builder.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::OutboxRelay;
use keel_policy::ConfigError;
use keel_policy::retry::Backoff;

use crate::broker::Broker;
#[cfg(feature = "fence")]
use crate::lease::LeaseGate;
use crate::store::OutboxStore;

/// The default wait between polls when there is nothing to publish.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// The default most rows per round.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// The default claim lease: how long other relays leave a claimed batch
/// alone, and so how soon a crashed relay's batch is republished.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default time a published row is kept before pruning.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// The default time between prune jobs.
pub const DEFAULT_PRUNE_INTERVAL: Duration = Duration::from_secs(600);
/// The default most rows deleted per prune statement.
pub const DEFAULT_PRUNE_BATCH: usize = 1_000;
/// The default least time between refreshes of the lag gauges.
pub const DEFAULT_STATS_INTERVAL: Duration = Duration::from_secs(1);

/// How a relay behaves. Build with [`OutboxRelay::builder`].
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// This relay's name in claims (default `relay-<uuid>`, new each
    /// start). A stable name (the pod name) lets a restarted relay take its
    /// own claims back at once instead of waiting out the lease; two live
    /// relays must never share one.
    pub name: String,
    /// The most rows published per round (default 100).
    pub batch_size: NonZeroUsize,
    /// The wait between polls when idle (default 200 ms).
    pub poll_interval: Duration,
    /// The claim lease (default 30 s).
    pub lease: Duration,
    /// How long published rows are kept (default 7 days).
    pub retention: Duration,
    /// The time between prune jobs (default 10 min).
    pub prune_interval: Duration,
    /// The most rows deleted per prune statement (default 1000), so a prune
    /// never holds a long write lock.
    pub prune_batch: NonZeroUsize,
    /// Move rows past their retention to `keel_outbox_archive` instead of
    /// deleting them (default: delete).
    pub archive: bool,
    /// The delays between failed rounds (default: 200 ms doubling to 10 s,
    /// full jitter).
    pub backoff: Backoff,
    /// The least time between refreshes of `keel_outbox_lag_seconds` and
    /// `keel_outbox_unpublished` (default 1 s).
    pub stats_interval: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            name: format!("relay-{}", keel_core::id::new_id()),
            batch_size: NonZeroUsize::new(DEFAULT_BATCH_SIZE).unwrap_or(NonZeroUsize::MIN),
            poll_interval: DEFAULT_POLL_INTERVAL,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            prune_interval: DEFAULT_PRUNE_INTERVAL,
            prune_batch: NonZeroUsize::new(DEFAULT_PRUNE_BATCH).unwrap_or(NonZeroUsize::MIN),
            archive: false,
            backoff: Backoff::default(),
            stats_interval: DEFAULT_STATS_INTERVAL,
        }
    }
}

impl RelayOptions {
    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("poll_interval", self.poll_interval),
            ("lease", self.lease),
            ("retention", self.retention),
            ("prune_interval", self.prune_interval),
        ];
        for (field, value) in positive {
            if value.is_zero() {
                return Err(ConfigError::new(field, "must be greater than zero"));
            }
        }
        if self.name.is_empty() {
            return Err(ConfigError::new("name", "must not be empty"));
        }
        Ok(())
    }
}

/// Builds an [`OutboxRelay`].
#[derive(Debug)]
pub struct RelayBuilder<S, B: ?Sized> {
    pub(super) store: S,
    pub(super) broker: Arc<B>,
    pub(super) wake: Arc<Notify>,
    pub(super) options: RelayOptions,
    #[cfg(feature = "fence")]
    pub(super) prune_gate: Option<LeaseGate>,
}

impl<S: OutboxStore, B: Broker + ?Sized> RelayBuilder<S, B> {
    /// Replaces all options at once.
    pub fn options(mut self, options: RelayOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets the relay's name in claims.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.options.name = name.into();
        self
    }

    /// Sets the most rows per round.
    pub fn batch_size(mut self, rows: NonZeroUsize) -> Self {
        self.options.batch_size = rows;
        self
    }

    /// Sets the wait between polls when idle.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.options.poll_interval = interval;
        self
    }

    /// Sets the claim lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// Sets how long published rows are kept.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.options.retention = retention;
        self
    }

    /// Sets the time between prune jobs.
    pub fn prune_interval(mut self, interval: Duration) -> Self {
        self.options.prune_interval = interval;
        self
    }

    /// Sets the most rows deleted per prune statement.
    pub fn prune_batch(mut self, rows: NonZeroUsize) -> Self {
        self.options.prune_batch = rows;
        self
    }

    /// Archives published rows past their retention
    /// ([`OutboxStore::outbox_archive`]) instead of deleting them: the
    /// outbox stays small and an audit can still ask, a year later,
    /// whether an event went out
    /// ([`OutboxAdminStore::outbox_archived`](crate::store::OutboxAdminStore::outbox_archived)).
    pub fn archive(mut self, archive: bool) -> Self {
        self.options.archive = archive;
        self
    }

    #[cfg(feature = "fence")]
    /// Prunes (or archives) only while this process holds `gate`'s lease,
    /// so that of several relays sharing a database one does the job.
    /// Give the lease a length of a few prune intervals: each prune round
    /// extends it, and another relay takes over once it runs out.
    pub fn prune_under(mut self, gate: LeaseGate) -> Self {
        self.prune_gate = Some(gate);
        self
    }

    /// Sets the delays between failed rounds.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }

    /// Builds the relay, refusing zero durations and an empty name.
    pub fn build(self) -> Result<OutboxRelay<S, B>, ConfigError> {
        self.options.validate()?;
        Ok(OutboxRelay {
            store: self.store,
            broker: self.broker,
            wake: self.wake,
            options: self.options,
            #[cfg(feature = "fence")]
            prune_gate: self.prune_gate,
            last_stats: parking_lot::Mutex::new(None),
        })
    }
}
