//! How a [`SqliteStore`](super::SqliteStore) opens its database.

use std::num::NonZeroU32;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use keel_store::StoreError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::SqliteStore;
use super::error::db_error;
use super::gate::CommitGate;

/// Options for opening a [`SqliteStore`], with documented defaults.
///
/// ```no_run
/// # async fn demo() -> Result<(), keel_store::StoreError> {
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use keel_sqlite::store::SqliteStoreOptions;
///
/// let store = SqliteStoreOptions::new()
///     .read_connections(NonZeroU32::new(8).expect("non-zero"))
///     .busy_timeout(Duration::from_secs(2))
///     .open("keel.db")
///     .await?;
/// # drop(store); Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStoreOptions {
    read_connections: NonZeroU32,
    busy_timeout: Duration,
    synchronous: SqliteSynchronous,
}

impl Default for SqliteStoreOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl SqliteStoreOptions {
    /// The defaults: 4 read connections, a 5 s busy timeout,
    /// `synchronous = FULL`.
    pub fn new() -> Self {
        Self {
            read_connections: NonZeroU32::new(4).unwrap_or(NonZeroU32::MIN),
            busy_timeout: Duration::from_secs(5),
            synchronous: SqliteSynchronous::Full,
        }
    }

    /// How many connections serve reads that are not part of a transaction
    /// (listing dead letters, loading sagas, stats). Default 4. Writes always
    /// go through the one writer connection (see the module docs for why).
    pub fn read_connections(mut self, n: NonZeroU32) -> Self {
        self.read_connections = n;
        self
    }

    /// How long a write waits for SQLite's single write lock, whether another
    /// process holds it (SQLite's busy handler) or another task of this
    /// process does (the writer connection's queue). After that the
    /// operation fails with [`StoreError::Unavailable`], which is retryable.
    /// Default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// SQLite's `synchronous` setting. Default `FULL`: every commit is
    /// fsynced before it returns, so a commit that Keel acts on (publishing
    /// an event, acking a message, handing out a fencing token) survives a
    /// power loss. `NORMAL` is faster in WAL mode and still safe against a
    /// process crash, but a power loss may undo the last commits *after* the
    /// relay published them or the consumer acked them; choose it only if
    /// that is acceptable.
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Opens (creating if missing, readable by the owner only) the
    /// database file at `path` in WAL mode and migrates it.
    pub async fn open(self, path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        crate::private_file::create_private(path.as_ref()).map_err(|e| {
            StoreError::Unavailable(format!("creating {}: {e}", path.as_ref().display()).into())
        })?;
        let base = SqliteConnectOptions::new()
            .filename(path.as_ref())
            .create_if_missing(true);
        // Inside the writer's open batch every write statement keeps a
        // statement journal, so that it can be undone alone; in a temporary
        // file, each page it journals is a `pwrite`, made while every other
        // writer waits. In memory it is a copy.
        let writer_options = self
            .connect_options(base.clone())
            .journal_mode(SqliteJournalMode::Wal)
            .pragma("temp_store", "MEMORY");
        let gate = CommitGate::default();
        let writer = gate
            .install_on(self.pool_options(1))
            .connect_with(writer_options)
            .await
            .map_err(db_error)?;
        // Readers refuse writes, so a read path can never take the write lock.
        let reader_options = self.connect_options(base).pragma("query_only", "ON");
        let reader = self
            .pool_options(self.read_connections.get())
            .connect_lazy_with(reader_options);
        SqliteStore::from_pools(writer, reader, Some(path.as_ref()), gate).await
    }

    /// Opens a private in-memory database (for tests and examples). It lives
    /// as long as the store, on one connection shared by reads and writes, so
    /// do not call the store's non-transactional methods while holding one
    /// of its transactions.
    pub async fn open_in_memory(self) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:").map_err(db_error)?;
        let gate = CommitGate::default();
        let pool = gate
            .install_on(self.pool_options(1))
            .connect_with(self.connect_options(options))
            .await
            .map_err(db_error)?;
        SqliteStore::from_pools(pool.clone(), pool, None, gate).await
    }

    fn connect_options(&self, base: SqliteConnectOptions) -> SqliteConnectOptions {
        base.busy_timeout(self.busy_timeout)
            .synchronous(self.synchronous)
            .foreign_keys(true)
    }

    /// Connections live as long as the store: an embedded database has no
    /// network that could break them, and an in-memory one dies with its
    /// connection.
    fn pool_options(&self, max: u32) -> SqlitePoolOptions {
        crate::pool::guarded_pool_options()
            .max_connections(max)
            .acquire_timeout(self.busy_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
    }
}
