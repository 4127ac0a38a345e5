//! How SQLite's failures become [`StoreError`]s.
//!
//! Callers retry on [`StoreError::Unavailable`] only, so the mapping decides
//! what is transient: SQLite's `BUSY` and `LOCKED` (another writer held the
//! lock for longer than the busy timeout), a pool that had no connection in
//! time, and I/O errors. A unique violation is a [`StoreError::Conflict`].
//! A failed `COMMIT` whose cause is not a lock is
//! [`StoreError::OutcomeUnknown`]: the caller must read back, not guess.

use keel_store::StoreError;
use sqlx::error::ErrorKind;

/// SQLite's primary result codes for "another connection holds the lock".
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
/// SQLite's primary result code for an error in the SQL itself.
const SQLITE_ERROR: i32 = 1;

/// A [`StoreError::Other`] for a row that does not decode.
pub(crate) fn corrupt(what: &'static str, detail: impl ToString) -> StoreError {
    keel_sql::error::corrupt("SQLite", what, detail)
}

/// Maps an error of an ordinary statement.
pub(crate) fn db_error(err: sqlx::Error) -> StoreError {
    if is_busy(&err) {
        metrics::counter!("keel_sqlite_busy_total").increment(1);
        tracing::debug!(error = %err, "sqlite store busy");
        return StoreError::Unavailable(err.into());
    }
    match err {
        sqlx::Error::Database(db) if db.kind() == ErrorKind::UniqueViolation => {
            StoreError::Conflict(db.message().to_owned())
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => {
            StoreError::Unavailable(err.into())
        }
        other => StoreError::other(other),
    }
}

/// Whether `err` is SQLite's `BUSY` or `LOCKED` (any extended code).
pub(crate) fn is_busy(err: &sqlx::Error) -> bool {
    primary_code(err).is_some_and(|code| matches!(code, SQLITE_BUSY | SQLITE_LOCKED))
}

/// Whether `err` is SQLite's generic `ERROR`: a statement SQLite refused
/// to run as written.
pub(crate) fn is_sql_error(err: &sqlx::Error) -> bool {
    primary_code(err) == Some(SQLITE_ERROR)
}

/// SQLite's primary result code of a database error.
fn primary_code(err: &sqlx::Error) -> Option<i32> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    db.code()
        .and_then(|code| code.parse::<i32>().ok())
        .map(|code| code & 0xff)
}

pub(crate) use keel_sql::error::sql_limit;
