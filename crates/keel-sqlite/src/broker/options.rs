//! How a [`SqliteBroker`](super::SqliteBroker) keeps, dedupes and delivers
//! messages.

use std::path::Path;
use std::time::Duration;

use keel_store::broker::BrokerError;
use sqlx::sqlite::{SqlitePool, SqliteSynchronous};

use super::SqliteBroker;

/// Options of a [`SqliteBroker`](super::SqliteBroker). Every setting has a
/// documented default; invalid values are refused when the broker opens.
///
/// ```
/// use std::time::Duration;
/// use keel_sqlite::broker::SqliteBrokerOptions;
///
/// let options = SqliteBrokerOptions::new()
///     .retention(Duration::from_secs(600))
///     .dedupe_window(Duration::from_secs(300))
///     .poll_interval(Duration::from_millis(50));
/// assert_eq!(options.kept_for(), Duration::from_secs(600));
/// ```
#[derive(Debug, Clone)]
pub struct SqliteBrokerOptions {
    pub(super) retention: Duration,
    pub(super) dedupe_window: Duration,
    pub(super) poll_interval: Duration,
    pub(super) prune_interval: Option<Duration>,
    pub(super) prune_batch: u32,
    pub(super) pull_batch: u32,
    pub(super) max_message_bytes: usize,
    pub(super) synchronous: SqliteSynchronous,
    pub(super) max_connections: u32,
}

impl Default for SqliteBrokerOptions {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(3600),
            dedupe_window: Duration::from_secs(120),
            poll_interval: Duration::from_millis(100),
            prune_interval: Some(Duration::from_secs(30)),
            prune_batch: 1000,
            pull_batch: 256,
            max_message_bytes: 1024 * 1024,
            synchronous: SqliteSynchronous::Full,
            max_connections: 4,
        }
    }
}

impl SqliteBrokerOptions {
    /// Opens (creating if needed, readable by the owner only) the broker in
    /// the database file at `path`: WAL mode, these options' `synchronous`
    /// setting and pool size, a 5 s busy timeout for writers in other
    /// processes.
    pub async fn open(self, path: impl AsRef<Path>) -> Result<SqliteBroker, BrokerError> {
        SqliteBroker::open_file(path, self).await
    }

    /// Opens a broker in a private in-memory database: for tests and demos;
    /// it vanishes with the last clone.
    pub async fn open_in_memory(self) -> Result<SqliteBroker, BrokerError> {
        SqliteBroker::open_memory(self).await
    }

    /// The broker on an existing pool (for example the store's, so both
    /// share one file). Runs the broker's migrations (numbered 2xxx, so they
    /// coexist with the store's) and starts the settle and pruning tasks on
    /// the current tokio runtime. The pool's pragmas are the caller's: use
    /// WAL mode and a busy timeout for file databases.
    pub async fn from_pool(self, pool: SqlitePool) -> Result<SqliteBroker, BrokerError> {
        SqliteBroker::on_pool(pool, self).await
    }

    /// The defaults (see each setter).
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a message stays after every consumer group acked or
    /// terminated it, so a group created later can still read it. Default:
    /// one hour.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How long a message id is remembered for publisher dedupe. Ids are
    /// remembered as long as their message is kept, so a message is kept for
    /// at least this long too (see [`kept_for`](Self::kept_for)). Default: two
    /// minutes, like JetStream's duplicate window.
    pub fn dedupe_window(mut self, window: Duration) -> Self {
        self.dedupe_window = window;
        self
    }

    /// How often a waiting `receive` looks for messages published by another
    /// process (publishes in this process wake it at once). Default: 100 ms.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How often the background pruner deletes settled messages older than
    /// [`kept_for`](Self::kept_for); `None` turns it off (call
    /// [`SqliteBroker::prune`](super::SqliteBroker::prune) yourself).
    /// Default: every 30 s.
    pub fn prune_interval(mut self, interval: Option<Duration>) -> Self {
        self.prune_interval = interval;
        self
    }

    /// At most this many messages per topic are deleted in one pruning
    /// transaction, so pruning never holds the write lock for long. Default:
    /// 1000.
    pub fn prune_batch(mut self, batch: u32) -> Self {
        self.prune_batch = batch;
        self
    }

    /// How many new messages a group copies into its pending set at a time
    /// when it runs short of deliverable ones. Default: 256.
    pub fn pull_batch(mut self, batch: u32) -> Self {
        self.pull_batch = batch;
        self
    }

    /// The largest message (payload plus headers) a publish accepts; larger
    /// ones are refused with [`BrokerError::Invalid`] (use a claim check).
    /// Default: 1 MiB.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// SQLite's `synchronous` setting for databases the broker opens itself.
    /// `Full` (the default) survives power loss at the cost of an fsync per
    /// commit; `Normal` in WAL mode survives process crashes but may lose the
    /// last commits on power loss. The default is `Full` because the outbox
    /// relay marks a row published once the broker accepted it: a publish
    /// lost afterwards would be a message lost for good.
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// The connection pool size for databases the broker opens itself.
    /// Writes are serialized anyway; extra connections serve concurrent
    /// reads. Default: 4.
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections;
        self
    }

    /// How long a settled message is kept: the longer of the retention and
    /// the dedupe window.
    pub fn kept_for(&self) -> Duration {
        self.retention.max(self.dedupe_window)
    }

    pub(super) fn validate(&self) -> Result<(), BrokerError> {
        let refuse = |what: &str| Err(BrokerError::Invalid(format!("{what} must be positive")));
        if self.poll_interval.is_zero() {
            return refuse("poll_interval");
        }
        if self
            .prune_interval
            .is_some_and(|interval| interval.is_zero())
        {
            return refuse("prune_interval");
        }
        if self.prune_batch == 0 {
            return refuse("prune_batch");
        }
        if self.pull_batch == 0 {
            return refuse("pull_batch");
        }
        if self.max_message_bytes == 0 {
            return refuse("max_message_bytes");
        }
        if self.max_connections == 0 {
            return refuse("max_connections");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_zeroes_are_refused() {
        assert!(SqliteBrokerOptions::new().validate().is_ok());
        let bad = [
            SqliteBrokerOptions::new().poll_interval(Duration::ZERO),
            SqliteBrokerOptions::new().prune_interval(Some(Duration::ZERO)),
            SqliteBrokerOptions::new().prune_batch(0),
            SqliteBrokerOptions::new().pull_batch(0),
            SqliteBrokerOptions::new().max_message_bytes(0),
            SqliteBrokerOptions::new().max_connections(0),
        ];
        for options in bad {
            assert!(
                matches!(options.validate(), Err(BrokerError::Invalid(_))),
                "{options:?}"
            );
        }
    }

    #[test]
    fn messages_are_kept_for_the_longer_of_retention_and_dedupe_window() {
        let options = SqliteBrokerOptions::new()
            .retention(Duration::from_secs(10))
            .dedupe_window(Duration::from_secs(60));
        assert_eq!(options.kept_for(), Duration::from_secs(60));
    }
}
