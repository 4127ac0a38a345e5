//! The messaging [`Store`] on SQLite: outbox, inbox, dead letters, sagas and
//! fencing tokens in the same file as the application's own tables.
//!
//! The point of the outbox and the inbox is that Keel's row commits in the
//! *user's* transaction. So [`SqliteStore::begin`] hands out a [`WriteTx`]
//! that lends its `SqliteConnection` exactly as a `sqlx::Transaction` does:
//! write your business rows in it with your own SQL (`.execute(&mut *tx)`),
//! add Keel's rows with the same `&mut tx`, and commit once.
//!
//! ```
//! use keel_store::{OutboxRecord, OutboxStore, Store};
//! use keel_sqlite::store::SqliteStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = SqliteStore::open_in_memory().await?;
//! sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, total_minor INTEGER NOT NULL)")
//!     .execute(store.pool())
//!     .await?;
//!
//! // One transaction: the order row and the event that announces it.
//! let mut tx = store.begin().await?;
//! sqlx::query("INSERT INTO orders (id, total_minor) VALUES (?, ?)")
//!     .bind("A-4471")
//!     .bind(8210)
//!     .execute(&mut *tx)
//!     .await?;
//! let event = OutboxRecord {
//!     event_id: "0190f5c4-6a1e-7b2c-9d3e-4f5a6b7c8d9e".into(),
//!     topic: "orders".into(),
//!     partition_key: "A-4471".into(),
//!     headers: Default::default(),
//!     payload: br#"{"orderId":"A-4471"}"#.as_slice().into(),
//! };
//! store.outbox_append(&mut tx, &[event]).await?;
//! store.commit(tx).await?;
//!
//! // Both rows are there, or neither would be.
//! assert_eq!(store.outbox_stats().await?.unpublished, 1);
//! # Ok(()) }
//! ```
//!
//! # Why one writer connection
//!
//! SQLite lets one connection write at a time. With several writer
//! connections the others spin in SQLite's busy handler, sleeping and
//! retrying, which is slow and unfair under load. So the store has exactly
//! one writer connection: every transaction from [`SqliteStore::begin`] and
//! every write method queues for it in one FIFO, and reads that are
//! not part of a transaction go to a separate pool of read connections
//! (WAL lets them run while a write is in progress). The busy timeout still
//! matters when another process, or the embedded broker's own pool, writes
//! to the same file.
//!
//! A consequence: while you hold a transaction, this store's other *write*
//! methods wait for it. Do not call them from inside a transaction you hold;
//! pass the transaction to the methods that take one instead.
//!
//! # Why group commit
//!
//! With `synchronous = FULL` each `COMMIT` waits for an fsync, so committing
//! transactions one by one caps the store at the disk's sync rate. The
//! writer therefore folds the transactions that queue for it while a batch
//! is open into one physical transaction: each [`WriteTx`] is a savepoint
//! in it, and one `COMMIT` (one fsync) settles them all. A failed
//! transaction rolls back its savepoint only; [`Store::commit`] answers
//! after the fsync that covers the caller's writes, never before. The
//! store's own single-statement writes take the same path, without the
//! savepoint: SQLite applies or undoes one statement as a whole.
//!
//! The price is one more rule: **do not wait, inside an open transaction,
//! for another of this store's commits to be acknowledged.** That commit
//! may be in your transaction's batch, which cannot end before yours does.
//!
//! # Why `BEGIN IMMEDIATE`
//!
//! SQLite starts a plain (`DEFERRED`) transaction as a reader and upgrades it
//! to a writer at its first write. If another connection committed in
//! between, the upgrade fails at once with `SQLITE_BUSY`, without waiting,
//! and the whole transaction must be retried: a read-then-write business
//! transaction fails randomly under concurrency. [`SqliteStore::begin`]
//! therefore says `BEGIN IMMEDIATE`, which takes the write lock up front
//! (waiting up to the busy timeout for it). It runs in a task of its own, so
//! a caller dropped while it waits cannot leave the connection inside a
//! transaction nobody owns, and every pool the crate opens rolls such a
//! transaction back at checkout (see `pool.rs`: under load one cancelled
//! `BEGIN` used to hold the write lock and swallow later writes).
//! Every transaction `begin` hands out is a write transaction; that is what
//! the outbox and inbox are for. Keel's own single-statement writes join the
//! same batches.
//!
//! # Why `synchronous = FULL`
//!
//! In WAL mode `NORMAL` skips the fsync at commit, so a power loss (not a
//! process crash) can undo the last few commits. For this store that would
//! be worse than slow: the relay may already have published an event whose
//! order then vanished, a consumer may have acked a message whose effect then
//! vanished, and a fencing token could be handed out twice. The default is
//! therefore `FULL`; [`SqliteStoreOptions::synchronous`] can relax it.
//!
//! # Schema
//!
//! Migrations are embedded (`migrations/store`, versions 1001 and up, so
//! they never clash with the broker's 2xxx versions in a shared file) and run
//! on open. Tables are prefixed `keel_`. Timestamps are Unix milliseconds.

pub(crate) mod codec;
mod dialect;
pub(crate) mod error;
mod gate;
mod group;
mod options;
mod outbox;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use keel_store::Store;
use keel_store::StoreError;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::query::Query;
use sqlx::sqlite::{Sqlite, SqliteArguments, SqlitePool, SqliteRow};

pub use dialect::SqliteDialect;
pub use group::WriteTx;
pub use options::SqliteStoreOptions;
pub use sqlx::sqlite::SqliteSynchronous;

use error::db_error;
use group::GroupCommit;

/// The first and last migration version this store owns.
const VERSIONS: std::ops::RangeInclusive<i64> = 1001..=1999;

/// The messaging [`Store`] on SQLite. Cheap to clone; clones share the pools.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// One connection: all transactions and writes (see the module docs).
    writer: SqlitePool,
    /// The queue for the writer, folding transactions into batches.
    group: GroupCommit,
    /// Reads outside transactions.
    reader: SqlitePool,
    /// The file [`SqliteStoreOptions::open`] was given.
    file: Option<Arc<Path>>,
}

impl SqliteStore {
    /// Opens (creating if missing) the database file at `path` with the
    /// default [`SqliteStoreOptions`], and migrates it.
    pub async fn open(path: impl AsRef<std::path::Path>) -> Result<Self, StoreError> {
        SqliteStoreOptions::new().open(path).await
    }

    /// Opens a private in-memory database with the default options.
    pub async fn open_in_memory() -> Result<Self, StoreError> {
        SqliteStoreOptions::new().open_in_memory().await
    }

    /// Options for opening a store.
    pub fn options() -> SqliteStoreOptions {
        SqliteStoreOptions::new()
    }

    /// A store on a pool you configured yourself (it is used for reads and
    /// writes alike), after migrating it. Configure WAL mode and a busy
    /// timeout on it; with several connections, writers wait for each other
    /// in SQLite's busy handler rather than in a queue.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, StoreError> {
        Self::from_pools(pool.clone(), pool, None, gate::CommitGate::default()).await
    }

    /// A store on `writer` and `reader`; `gate` is the commit gate installed
    /// on `writer`'s connections, if any (`gate.rs`).
    pub(crate) async fn from_pools(
        writer: SqlitePool,
        reader: SqlitePool,
        file: Option<&Path>,
        gate: gate::CommitGate,
    ) -> Result<Self, StoreError> {
        migrate(&writer).await?;
        Ok(Self {
            group: GroupCommit::new(writer.clone(), gate),
            writer,
            reader,
            file: file.map(Arc::from),
        })
    }

    /// The database file this store was opened on; `None` for a store in
    /// memory or from a pool.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The pool for writes and transactions: run your own schema migrations
    /// and writes here. For business writes that go with an event, use
    /// [`Store::begin`] and `sqlx::query(..).execute(&mut *tx)` instead.
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
    }

    /// Connections the pool could hand out right now without waiting: the
    /// idle ones and those not opened yet. For readiness (pool
    /// exhaustion); reads no database.
    pub fn connections_free(&self) -> usize {
        keel_sql::backend::connections_free(&self.writer)
    }

    /// The pool for reads outside a transaction; its connections refuse
    /// writes (`PRAGMA query_only`) unless the store came from
    /// [`SqliteStore::from_pool`] or is in memory.
    pub fn read_pool(&self) -> &SqlitePool {
        &self.reader
    }

    /// The embedded migrations, set to ignore versions they do not know (the
    /// broker's, in a shared file). Run them yourself if you open pools some
    /// other way.
    pub fn migrator() -> Migrator {
        let mut migrator = sqlx::migrate!("./migrations/store");
        migrator.set_ignore_missing(true);
        migrator
    }

    /// Runs a claim (one `UPDATE ... RETURNING` statement) in the group
    /// commit, like every write: on the writer pool outside it, a claim
    /// would wait for the open batch and then fsync alone.
    pub(crate) async fn claim<'q>(
        &self,
        claim: Query<'q, Sqlite, SqliteArguments>,
    ) -> Result<Vec<SqliteRow>, StoreError> {
        let mut tx = self.group.begin_statement().await?;
        let rows = claim.fetch_all(&mut *tx).await.map_err(db_error)?;
        self.group.commit(tx).await?;
        Ok(rows)
    }

    /// Closes both pools, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }
}

/// Runs the embedded migrations. Two processes opening a new file at the
/// same moment can race to apply the same version; the loser fails, so try
/// a few times (the second pass sees the winner's work).
async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    let migrator = SqliteStore::migrator();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match migrator.run(pool).await {
            Ok(()) => return Ok(()),
            Err(err) if attempt < 3 => {
                tracing::debug!(error = %err, attempt, "sqlite store migration failed, retrying");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(MigrateError::Execute(err)) => return Err(db_error(err)),
            Err(err) => return Err(StoreError::other(err)),
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    type Tx = WriteTx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.group.begin().await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.group.commit(tx).await
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.group.rollback(tx).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        keel_sql::schema::check_migrated(self, &Self::migrator(), VERSIONS, "sqlite store schema")
            .await
    }
}
