//! Group commit: many logical write transactions, one physical transaction
//! and one fsync.
//!
//! With `synchronous = FULL` every `COMMIT` waits for an fsync, and SQLite
//! has one writer, so a store that commits each transaction on its own
//! commits about as often per second as the disk syncs. Group commit keeps
//! the writer's physical transaction open while other transactions are
//! queued for it: each [`WriteTx`] is a savepoint inside that transaction,
//! and one `COMMIT` (one fsync) settles every savepoint released before it.
//!
//! The store's own writes are one statement each (a saga save, a claim, a
//! mark), and SQLite applies or undoes a single statement as a whole, so
//! those skip the savepoint: a savepoint and its release are two more round
//! trips to the connection's thread while holding the writer, and the
//! writer's hold per logical transaction, not the fsync, is what bounds a
//! busy store.
//!
//! The rules that keep each caller's answer true:
//! - **A caller is answered only after the fsync that covers its writes,
//!   and what it read.** Releasing a savepoint answers nobody;
//!   [`GroupCommit::commit`] waits for the batch's `COMMIT`. So does
//!   [`GroupCommit::rollback`]: a transaction reads the rows that others
//!   released into its batch before they are durable, and a caller that
//!   rolls back because of what it read (a duplicate to ack, a stored
//!   answer to replay) acts on those rows. A batch that then fails makes
//!   the rollback fail too, so nobody acts on a read that did not survive.
//! - **A failed logical transaction does not poison the others.** Its
//!   savepoint is rolled back (explicitly, or when the handle is dropped)
//!   and the batch goes on. Only an error that ends the physical
//!   transaction itself (SQLite rolls the whole transaction back on a full
//!   disk, an I/O error or an `OR ROLLBACK` conflict) fails the batch, and
//!   then every caller in it is told its writes did not commit. A
//!   single-statement write that fails, or whose caller goes away, has no
//!   savepoint to roll back; before anyone else uses the connection the
//!   writer checks that the batch's transaction is still open.
//! - **A batch never waits for a caller that has gone.** Its first release
//!   queues a flush behind the transactions already waiting (the writer's
//!   queue is FIFO): it commits the batch once they have had their turn, so
//!   a batch folds the transactions that queued before its first release,
//!   and nothing depends on a caller coming back. Every step that touches
//!   the connection runs in a task of its own, so a dropped caller cannot
//!   cut one in half (see `pool.rs`).
//! - **A single-statement write whose caller goes away may still commit**,
//!   as an autocommit statement on PostgreSQL may: if it ran, it is part of
//!   the batch.
//!
//! The histogram `keel_sqlite_group_commit_size` records how many logical
//! transactions each `COMMIT` settled.
//!
//! While a batch is open it holds the writer pool's one connection, so a
//! write that bypasses the group (the store's rare reads on the writer, or
//! yours on [`SqliteStore::pool`](super::SqliteStore::pool)) waits for the
//! batch's `COMMIT`, and is durable when it returns.

use std::future::{Future, poll_fn};
use std::ops::{Deref, DerefMut};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;

use keel_store::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool, SqliteTransactionManager};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{Mutex, OwnedMutexGuard, oneshot};

use super::error::{db_error, is_busy, is_sql_error};
use super::gate::{CommitGate, ShutGate};

mod statements;
#[cfg(test)]
mod tests;

use statements::{OPEN_SAVEPOINT, RELEASE_SAVEPOINT, UNDO_SAVEPOINT, commit_batch, savepoint};

/// Savepoints released before a batch commits regardless of who is queued:
/// bounds the latency the first caller of a long queue pays.
const MAX_BATCH: usize = 256;

/// The writer of one store: its queue, its open batch, its counters.
#[derive(Debug, Clone)]
pub(crate) struct GroupCommit {
    pool: SqlitePool,
    gate: CommitGate,
    writer: Arc<Mutex<Writer>>,
    stats: Arc<Stats>,
}

#[derive(Debug, Default)]
struct Writer {
    batch: Option<Batch>,
    opened: u64,
}

/// The invariants behind the `expect`s: a `WriteTx` holds the writer until
/// it is committed or rolled back, and the writer it holds has a batch open.
const UNSETTLED: &str = "an unsettled WriteTx holds the writer";
const IN_A_BATCH: &str = "a WriteTx lives in a batch";

impl Writer {
    /// The batch of the `WriteTx` holding this writer.
    fn open_batch(&mut self) -> &mut Batch {
        self.batch.as_mut().expect(IN_A_BATCH)
    }
}

/// How a logical transaction keeps its writes apart from the rest of its
/// batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// A savepoint: any number of statements, undone together.
    Savepoint,
    /// Exactly one statement, which SQLite applies or undoes by itself.
    Statement,
}

/// Runs `step` in a task of its own, so that a caller going away cannot cut
/// it in half. Its task only fails to finish when the runtime is going down
/// (no step panics).
async fn in_own_task<T: Send + 'static>(
    step: impl Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::spawn(step).await.unwrap_or_else(|_| {
        Err(StoreError::Unavailable(
            "the runtime is shutting down".into(),
        ))
    })
}

/// The physical transaction, on the writer pool's connection.
#[derive(Debug)]
struct Batch {
    id: u64,
    conn: PoolConnection<Sqlite>,
    /// Shut while the batch is open: nothing but its `COMMIT` commits on
    /// its connection (`gate.rs`). Declared after `conn`, so that it opens
    /// only once a connection dropped with the batch has been let go.
    gate: ShutGate,
    waiters: Vec<oneshot::Sender<Verdict>>,
    /// Whether a flush of this batch is queued for the writer already: the
    /// first one queued commits the batch, so a second would only take a
    /// turn to find it gone.
    flush_queued: bool,
}

/// What became of a batch, told to each caller in it.
#[derive(Debug, Clone)]
enum Verdict {
    Committed,
    /// Nothing in the batch committed.
    RolledBack(Arc<sqlx::Error>),
    /// `COMMIT` failed in a way that may have come after the commit record.
    Unknown(Arc<sqlx::Error>),
}

/// Counters for tests and the batch-size metric.
#[derive(Debug, Default)]
struct Stats {
    commits: AtomicU64,
    flushes: AtomicU64,
    queued: AtomicUsize,
}

/// One caller in the writer's queue, counted for as long as it waits.
struct Queued<'a>(&'a Stats);

impl<'a> Queued<'a> {
    fn count(stats: &'a Stats) -> Self {
        stats.queued.fetch_add(1, Ordering::Relaxed);
        Self(stats)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

impl GroupCommit {
    pub(crate) fn new(pool: SqlitePool, gate: CommitGate) -> Self {
        Self {
            pool,
            gate,
            writer: Arc::default(),
            stats: Arc::default(),
        }
    }

    /// Physical commits so far.
    #[cfg(test)]
    pub(crate) fn commits(&self) -> u64 {
        self.stats.commits.load(Ordering::Relaxed)
    }

    /// Flushes queued so far.
    #[cfg(test)]
    pub(crate) fn flushes(&self) -> u64 {
        self.stats.flushes.load(Ordering::Relaxed)
    }

    /// Callers waiting for the writer right now.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.stats.queued.load(Ordering::Relaxed)
    }

    /// Opens a logical transaction: a savepoint in the open batch, or in a
    /// new one. Waits its turn for the writer, up to the pool's acquire
    /// timeout (the store's busy timeout).
    pub(crate) async fn begin(&self) -> Result<WriteTx, StoreError> {
        self.begin_in(Scope::Savepoint).await
    }

    /// Opens a logical transaction for exactly one statement, without a
    /// savepoint: run one statement on it and commit it. If it is dropped
    /// instead, its statement, if it ran, commits with the batch.
    pub(crate) async fn begin_statement(&self) -> Result<WriteTx, StoreError> {
        self.begin_in(Scope::Statement).await
    }

    async fn begin_in(&self, scope: Scope) -> Result<WriteTx, StoreError> {
        let writer = self.turn().await?;
        if scope == Scope::Statement && writer.batch.is_some() {
            // Nothing to send to the connection, so nothing to cut in half.
            return Ok(WriteTx {
                writer: Some(writer),
                group: self.clone(),
                scope,
            });
        }
        in_own_task(self.clone().open(writer, scope)).await
    }

    async fn open(
        self,
        mut writer: OwnedMutexGuard<Writer>,
        scope: Scope,
    ) -> Result<WriteTx, StoreError> {
        if writer.batch.is_none() {
            let mut conn = self.pool.acquire().await.map_err(db_error)?;
            SqliteTransactionManager::begin(
                &mut conn,
                Some(sqlx::SqlStr::from_static("BEGIN IMMEDIATE")),
            )
            .await
            .map_err(db_error)?;
            writer.opened += 1;
            writer.batch = Some(Batch {
                id: writer.opened,
                conn,
                gate: self.gate.shut(),
                waiters: Vec::new(),
                flush_queued: false,
            });
        }
        if scope == Scope::Savepoint
            && let Err(err) = savepoint(writer.open_batch(), OPEN_SAVEPOINT).await
        {
            return Err(self.abandon(&mut writer, err).await);
        }
        Ok(WriteTx {
            writer: Some(writer),
            group: self,
            scope,
        })
    }

    /// The writer, after the callers queued before this one.
    async fn turn(&self) -> Result<OwnedMutexGuard<Writer>, StoreError> {
        let limit = self.pool.options().get_acquire_timeout();
        let mut turn = pin!(tokio::time::timeout(
            limit,
            self.writer.clone().lock_owned()
        ));
        // A caller is counted as queued only once its first poll has put it
        // in the mutex's FIFO queue: whoever waits for N queued callers then
        // knows that they come before anything it queues next.
        let turn = match poll_fn(|cx| Poll::Ready(turn.as_mut().poll(cx))).await {
            Poll::Ready(turn) => turn,
            Poll::Pending => {
                let _queued = Queued::count(&self.stats);
                turn.await
            }
        };
        turn.map_err(|_| {
            StoreError::Unavailable(
                format!("the SQLite writer was busy for longer than {limit:?}").into(),
            )
        })
    }

    /// Commits the logical transaction `tx` and waits for the fsync that
    /// covers it.
    pub(crate) async fn commit(&self, mut tx: WriteTx) -> Result<(), StoreError> {
        let released = match tx.scope {
            // Nothing to release: joining the batch sends nothing to the
            // connection, so it needs no task of its own.
            Scope::Statement => Ok(Ok(self.wait_for_batch(tx.settle()))),
            Scope::Savepoint => tokio::spawn(tx.release()).await,
        };
        let verdict = match released {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(err)) => return Err(err),
            // The savepoint may have been released into a batch already.
            Err(_) => {
                return Err(StoreError::OutcomeUnknown(
                    "the runtime shut down while committing".into(),
                ));
            }
        };
        match verdict.await {
            Ok(Verdict::Committed) => Ok(()),
            Ok(Verdict::RolledBack(err)) => Err(StoreError::Unavailable(Box::new(err))),
            Ok(Verdict::Unknown(err)) => Err(StoreError::OutcomeUnknown(Box::new(err))),
            Err(_) => Err(StoreError::OutcomeUnknown(
                "the process stopped while committing the batch".into(),
            )),
        }
    }

    /// Rolls the logical transaction `tx` back, and answers once the batch
    /// it ran in has committed.
    ///
    /// The wait is the point: `tx` could read rows that other transactions
    /// released into the batch and that are not durable yet, and a caller
    /// that rolls back on the strength of such a read (a duplicate to ack,
    /// a stored response to replay) must not act before those rows are. If
    /// the batch does not commit, what `tx` read may be gone, and the caller
    /// hears [`StoreError::Unavailable`]: read again.
    pub(crate) async fn rollback(&self, mut tx: WriteTx) -> Result<(), StoreError> {
        let writer = tx.settle();
        let group = tx.group.clone();
        let scope = tx.scope;
        let verdict = in_own_task(async move {
            let writer = group.clone().undo(writer, scope).await?;
            Ok(group.wait_for_batch(writer))
        })
        .await?;
        match verdict.await {
            Ok(Verdict::Committed) => Ok(()),
            Ok(Verdict::RolledBack(err) | Verdict::Unknown(err)) => {
                Err(StoreError::Unavailable(Box::new(UnsettledRead(err))))
            }
            Err(_) => Err(StoreError::Unavailable(
                "the process stopped before the batch this transaction read from committed".into(),
            )),
        }
    }

    /// Undoes a logical transaction that will not be committed, and gives
    /// the writer back with its batch still open. Fails the batch if its
    /// physical transaction cannot be vouched for.
    async fn undo(
        self,
        mut writer: OwnedMutexGuard<Writer>,
        scope: Scope,
    ) -> Result<OwnedMutexGuard<Writer>, StoreError> {
        let batch = writer.open_batch();
        let undone = match scope {
            Scope::Savepoint => savepoint(batch, UNDO_SAVEPOINT).await,
            Scope::Statement => still_in_transaction(&mut batch.conn).await,
        };
        match undone {
            Ok(()) => Ok(writer),
            Err(err) => Err(self.abandon(&mut writer, err).await),
        }
    }

    /// Undoes a dropped logical transaction, whose caller hears nothing,
    /// then hands the writer on.
    async fn undo_dropped(self, writer: OwnedMutexGuard<Writer>, scope: Scope) {
        if let Ok(mut writer) = self.clone().undo(writer, scope).await {
            self.flush_later(writer.open_batch());
        }
    }

    /// Joins the batch's waiters, and commits the batch: at once if it is
    /// full, else once the callers queued now have had their turn.
    fn wait_for_batch(&self, mut writer: OwnedMutexGuard<Writer>) -> oneshot::Receiver<Verdict> {
        let batch = writer.open_batch();
        let (sender, verdict) = oneshot::channel();
        batch.waiters.push(sender);
        if batch.waiters.len() >= MAX_BATCH {
            let group = self.clone();
            tokio::spawn(async move { group.settle(&mut writer).await });
        } else {
            self.flush_later(batch);
        }
        verdict
    }

    /// Commits `batch` once the callers queued now have had their turn,
    /// unless a flush of it is queued already.
    fn flush_later(&self, batch: &mut Batch) {
        if std::mem::replace(&mut batch.flush_queued, true) {
            return;
        }
        self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        let id = batch.id;
        let group = self.clone();
        tokio::spawn(async move {
            let mut writer = group.writer.clone().lock_owned().await;
            if writer.batch.as_ref().is_some_and(|batch| batch.id == id) {
                group.settle(&mut writer).await;
            }
        });
    }

    /// Ends the open batch: `COMMIT` (one fsync) if any caller is waiting on
    /// it, `ROLLBACK` if none is; tells every caller.
    async fn settle(&self, writer: &mut Writer) {
        let Some(mut batch) = writer.batch.take() else {
            return;
        };
        if batch.waiters.is_empty() {
            let _ = SqliteTransactionManager::rollback(&mut batch.conn).await;
            return;
        }
        fail::fail_point!("keel-sqlite-group-before-commit", |_| {
            panic!("failpoint: the process dies before the batch's COMMIT")
        });
        batch.gate.commit_next();
        let verdict = match commit_batch(&mut batch.conn).await {
            Ok(()) => Verdict::Committed,
            Err(CommitFailure::RolledBack(err)) => Verdict::RolledBack(Arc::new(err)),
            Err(CommitFailure::Unknown(err)) => {
                tracing::warn!(error = %err, "sqlite group commit failed; outcome unknown");
                Verdict::Unknown(Arc::new(err))
            }
        };
        // A process that dies here committed (or not) without telling anyone:
        // the callers' retries must find what the disk kept.
        fail::fail_point!("keel-sqlite-group-after-commit");
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        metrics::histogram!("keel_sqlite_group_commit_size").record(batch.waiters.len() as f64);
        for waiter in batch.waiters {
            let _ = waiter.send(verdict.clone());
        }
    }

    /// Fails the open batch after `err` left its physical transaction in a
    /// state nobody can vouch for (a savepoint that would not open, release
    /// or roll back): everything in it is rolled back and every caller told.
    async fn abandon(&self, writer: &mut Writer, err: sqlx::Error) -> StoreError {
        let err = Arc::new(err);
        if let Some(mut batch) = writer.batch.take() {
            tracing::warn!(error = %err, callers = batch.waiters.len(), "sqlite group commit batch abandoned");
            // Whatever is still open; the pool's checkout guard rolls back
            // what this cannot.
            while SqliteTransactionManager::get_transaction_depth(&batch.conn) > 0 {
                if SqliteTransactionManager::rollback(&mut batch.conn)
                    .await
                    .is_err()
                {
                    break;
                }
            }
            for waiter in batch.waiters {
                let _ = waiter.send(Verdict::RolledBack(err.clone()));
            }
        }
        StoreError::Unavailable(Box::new(err))
    }
}

/// How a batch's `COMMIT` failed.
enum CommitFailure {
    /// Nothing in the batch committed.
    RolledBack(sqlx::Error),
    /// The commit record may or may not have reached the disk.
    Unknown(sqlx::Error),
}

/// Why a rollback could not vouch for what its transaction read.
#[derive(Debug, thiserror::Error)]
#[error(
    "the batch this transaction read from did not commit, so what it read may not be durable; \
     read again"
)]
struct UnsettledRead(#[source] Arc<sqlx::Error>);

fn batch_rolled_back() -> sqlx::Error {
    sqlx::Error::Protocol("SQLite had rolled the batch's transaction back".into())
}

/// Whether the batch's physical transaction is still open after a statement
/// whose caller did not commit it: an error that ended the transaction
/// would otherwise go unseen, and the next callers' statements would run,
/// and commit, outside it. A bare `BEGIN` fails inside a transaction and
/// starts one outside it (which [`GroupCommit::abandon`] then rolls back).
async fn still_in_transaction(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    match sqlx::query("BEGIN").execute(conn).await {
        Err(err) if is_sql_error(&err) => Ok(()),
        Err(err) => Err(err),
        Ok(_) => Err(batch_rolled_back()),
    }
}

/// A write transaction on the SQLite store: a savepoint in the writer's
/// open batch (see the module docs). Write your business rows in it with
/// `sqlx::query(..).execute(&mut *tx)`, exactly as in a
/// `sqlx::Transaction`; commit it with the store's `commit`, which answers
/// after the fsync. Roll it back with the store's `rollback`, which answers
/// once what it read is durable too. Dropping it rolls its writes back and
/// answers nobody: do not act on what a dropped transaction read.
#[derive(Debug)]
pub struct WriteTx {
    /// `Some` until the transaction is committed or rolled back.
    writer: Option<OwnedMutexGuard<Writer>>,
    group: GroupCommit,
    scope: Scope,
}

impl WriteTx {
    /// The writer, taken from a transaction being committed or rolled back.
    fn settle(&mut self) -> OwnedMutexGuard<Writer> {
        self.writer.take().expect(UNSETTLED)
    }

    /// Releases the savepoint and joins the batch's waiters; the answer
    /// comes with the batch's `COMMIT`.
    async fn release(mut self) -> Result<oneshot::Receiver<Verdict>, StoreError> {
        let mut writer = self.settle();
        let group = self.group.clone();
        if let Err(err) = savepoint(writer.open_batch(), RELEASE_SAVEPOINT).await {
            return Err(group.abandon(&mut writer, err).await);
        }
        Ok(group.wait_for_batch(writer))
    }
}

impl Deref for WriteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        let writer = self.writer.as_ref().expect(UNSETTLED);
        &writer.batch.as_ref().expect(IN_A_BATCH).conn
    }
}

impl DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.writer.as_mut().expect(UNSETTLED).open_batch().conn
    }
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        let Some(mut writer) = self.writer.take() else {
            return;
        };
        if writer.batch.is_none() {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            // The task holds the writer: nobody uses the connection before
            // the undo is done.
            tokio::spawn(self.group.clone().undo_dropped(writer, self.scope));
        } else if let Some(batch) = writer.batch.take() {
            // Without a runtime nothing can run the undo or commit the
            // batch: its connection closes (detached from the pool, whose
            // return needs a runtime), which rolls it back, and its callers
            // hear that the process stopped.
            drop(batch.conn.detach());
        }
    }
}
