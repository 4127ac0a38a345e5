//! Pools that never hand out a connection inside a transaction nobody owns,
//! and a `BEGIN` that a cancelled caller cannot cut in half.
//!
//! sqlx 0.8.6 raised a SQLite connection's transaction depth when its worker
//! thread had run `BEGIN`, but built the [`Transaction`] that would roll it
//! back only after a second await (the check that a custom `BEGIN
//! IMMEDIATE` did open a transaction). A `begin_with` dropped between the
//! two (a client hang-up, a deadline, a `timeout`) left the connection
//! inside a transaction with no owner, and it went back to the pool that
//! way. It kept the database's write lock, so every other writer waited out
//! its busy timeout; its next borrower's `begin` failed ("non-zero
//! transaction depth"); and its autocommit writes answered success inside a
//! transaction that never committed, so they vanished when it closed. Under
//! load this stalled the whole shop (the chaos suite found it). sqlx 0.9
//! rolls such a `BEGIN` back in the worker; the defences below stay,
//! because they cost no round trip and the store's writer drives sqlx's
//! transaction manager by hand (`store/group.rs`).
//!
//! Two defences: [`begin_immediate`] runs the `BEGIN` in a task of its own
//! (as the PostgreSQL store's `begin` does), so a dropped caller never
//! interrupts it (the task's transaction is dropped there and rolled back
//! the way sqlx knows how), and [`guarded_pool_options`] rolls back, at
//! checkout, whatever transaction a connection still holds. sqlx knows a
//! SQLite connection's depth exactly, so that check reads no database, and
//! the connection is kept: closing the only connection of an in-memory
//! database would drop the database.

use sqlx::Connection;
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePoolOptions};
use sqlx_core::transaction::TransactionManager;

/// Pool options whose checkout rolls back a transaction nobody owns.
pub(crate) fn guarded_pool_options() -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|conn, _meta| Box::pin(outside_a_transaction(conn)))
}

/// Rolls back what `conn` still holds (counted and logged); always keeps it.
async fn outside_a_transaction(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    if conn.is_in_transaction() {
        metrics::counter!("keel_sqlite_leaked_transactions_total").increment(1);
        tracing::warn!(
            "a pooled SQLite connection was inside a transaction nobody owns \
             (a cancelled BEGIN); rolling it back"
        );
        // One level per call: a nested leak unwinds savepoint by savepoint.
        while conn.is_in_transaction() {
            <Sqlite as sqlx::Database>::TransactionManager::rollback(conn).await?;
        }
    }
    Ok(true)
}

/// `BEGIN IMMEDIATE` on `pool`, in a task that finishes even if the caller
/// is dropped while waiting (see the module docs). The broker's; the store's
/// writer opens its batches the same way (`store/group.rs`).
#[cfg(feature = "broker")]
pub(crate) async fn begin_immediate(
    pool: &sqlx::SqlitePool,
) -> Result<sqlx::Transaction<'static, Sqlite>, sqlx::Error> {
    let pool = pool.clone();
    // The task only fails to join if it panicked or the runtime is going
    // down: either way no transaction exists.
    tokio::spawn(async move { pool.begin_with("BEGIN IMMEDIATE").await })
        .await
        .unwrap_or(Err(sqlx::Error::WorkerCrashed))
}
