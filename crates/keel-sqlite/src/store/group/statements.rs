//! The statements the group commit sends itself: the batch's `COMMIT`
//! (or the failure a failpoint arms in its place), and the savepoints each
//! logical transaction is.

use sqlx::SqliteConnection;
use sqlx::sqlite::SqliteTransactionManager;
use sqlx_core::transaction::TransactionManager;

use super::{Batch, CommitFailure, is_busy};

/// The batch's `COMMIT`, or the failure armed at the failpoint
/// `keel-sqlite-group-commit` in its place: `return(full)` is a disk that
/// filled at the commit (SQLite rolls the transaction back), `return(ioerr)`
/// an fsync that failed (the batch is rolled back, and its callers are told
/// the outcome is unknown, the worst a failed fsync can mean for them).
pub(super) async fn commit_batch(conn: &mut SqliteConnection) -> Result<(), CommitFailure> {
    if let Some(failure) = injected_commit_fault() {
        let _ = SqliteTransactionManager::rollback(conn).await;
        return Err(failure);
    }
    match SqliteTransactionManager::commit(conn).await {
        Ok(()) => Ok(()),
        Err(err) if is_busy(&err) => Err(CommitFailure::RolledBack(err)),
        Err(err) => Err(CommitFailure::Unknown(err)),
    }
}

/// The commit failure armed at `keel-sqlite-group-commit`, if any.
fn injected_commit_fault() -> Option<CommitFailure> {
    fail::fail_point!("keel-sqlite-group-commit", |arg| {
        let injected = |why: &str| sqlx::Error::Io(std::io::Error::other(why.to_owned()));
        Some(if arg.as_deref() == Some("full") {
            CommitFailure::RolledBack(injected(
                "injected: database or disk is full (SQLITE_FULL) at COMMIT",
            ))
        } else {
            CommitFailure::Unknown(injected(
                "injected: disk I/O error (SQLITE_IOERR_FSYNC) at COMMIT",
            ))
        })
    });
    None
}

/// A logical transaction's savepoint: opened, released, and undone (rolled
/// back, then released, in one round trip).
///
/// These are plain statements, not sqlx's nested transactions: sqlx answers
/// each `BEGIN`, `COMMIT` and `ROLLBACK` of its transaction manager with a
/// rendezvous, its connection's thread waiting until the caller's task has
/// taken the answer, which costs two more wake-ups per command while the
/// writer is held. A plain statement also says plainly when SQLite has ended
/// the batch's transaction by itself (an `OR ROLLBACK` conflict in the
/// savepoint, an I/O error): releasing or rolling back to a savepoint that
/// went with it fails ("no such savepoint"), where sqlx's rollback would
/// answer success. A savepoint is only ever opened in a transaction known to
/// be open (the batch's `BEGIN IMMEDIATE`, or a turn that ended with a
/// release, an undo, a check, or a single statement that succeeded, which
/// cannot have ended it), so it never starts one of its own.
pub(super) const OPEN_SAVEPOINT: &str = "SAVEPOINT keel_write";
pub(super) const RELEASE_SAVEPOINT: &str = "RELEASE keel_write";
pub(super) const UNDO_SAVEPOINT: &str = "ROLLBACK TO keel_write; RELEASE keel_write";

pub(super) async fn savepoint(
    batch: &mut Batch,
    statement: &'static str,
) -> Result<(), sqlx::Error> {
    sqlx::query(statement).execute(&mut *batch.conn).await?;
    Ok(())
}
