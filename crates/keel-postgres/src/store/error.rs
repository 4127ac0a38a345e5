//! How PostgreSQL's failures become [`StoreError`]s.
//!
//! Callers retry on [`StoreError::Unavailable`] only, so the mapping decides
//! what is transient: serialization failures (`40001`) and deadlocks
//! (`40P01`), whose transaction PostgreSQL rolled back and which succeed when
//! run again; lost connections, a server shutting down or starting up, too
//! many connections, a pool with no connection in time, and a statement
//! cancelled by its timeout. A unique violation is a
//! [`StoreError::Conflict`].
//!
//! `COMMIT` is different: a connection lost while it was in flight leaves
//! the outcome unknown (the server may have written the commit record and
//! died before answering), so it is [`StoreError::OutcomeUnknown`], and the
//! caller must read back rather than guess. An *answer* from the server to
//! `COMMIT` that is an ordinary error (a serialization failure under
//! `SERIALIZABLE`, a deferred constraint) means it rolled back.

use keel_store::StoreError;
use sqlx::error::ErrorKind;

/// SQLSTATE `serialization_failure`.
pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
/// SQLSTATE `deadlock_detected`.
pub(crate) const DEADLOCK_DETECTED: &str = "40P01";

/// A [`StoreError::Other`] for a row that does not decode.
pub(crate) fn corrupt(what: &'static str, detail: impl ToString) -> StoreError {
    keel_sql::error::corrupt("PostgreSQL", what, detail)
}

/// Maps an error of an ordinary statement.
pub(crate) fn db_error(err: sqlx::Error) -> StoreError {
    if is_transient(&err) {
        metrics::counter!("keel_postgres_transient_errors_total").increment(1);
        tracing::debug!(error = %err, "postgres store: transient error");
        return StoreError::Unavailable(err.into());
    }
    match err {
        sqlx::Error::Database(db) if db.kind() == ErrorKind::UniqueViolation => {
            StoreError::Conflict(db.message().to_owned())
        }
        other => StoreError::other(other),
    }
}

/// Maps an error of `COMMIT` (see the module docs).
pub(crate) fn commit_error(err: sqlx::Error) -> StoreError {
    if is_connection_lost(&err) {
        metrics::counter!("keel_postgres_commit_outcome_unknown_total").increment(1);
        tracing::warn!(error = %err, "postgres commit failed; outcome unknown");
        return StoreError::OutcomeUnknown(err.into());
    }
    db_error(err)
}

/// Maps the error of a write sent in autocommit: a connection that broke
/// with no answer from the server (an I/O error, a protocol error on a
/// half-read answer) may have lost the answer to a statement that
/// committed, so the write's outcome is unknown, as a lost `COMMIT`'s is.
/// An error the server answered with, or no connection in time, still says
/// nothing committed. An I/O error while a new connection was being set up
/// looks the same from here and is read as unknown too: the safe side.
pub(crate) fn autocommit_write_error(err: StoreError) -> StoreError {
    match err {
        StoreError::Unavailable(source)
            if source
                .downcast_ref::<sqlx::Error>()
                .is_some_and(is_answer_lost) =>
        {
            metrics::counter!("keel_postgres_commit_outcome_unknown_total").increment(1);
            tracing::warn!(error = %source, "postgres autocommit write lost its answer; outcome unknown");
            StoreError::OutcomeUnknown(source)
        }
        other => other,
    }
}

/// The connection broke before the server's answer was read.
fn is_answer_lost(err: &sqlx::Error) -> bool {
    matches!(
        err,
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_)
    )
}

/// Whether running the operation again may succeed: a conflict between
/// transactions or a connection/server problem.
pub(crate) fn is_transient(err: &sqlx::Error) -> bool {
    is_conflict(err) || is_connection_lost(err) || is_overloaded(err)
}

/// A serialization failure or a deadlock: PostgreSQL rolled the whole
/// transaction back, and running it again is the documented remedy.
pub(crate) fn is_conflict(err: &sqlx::Error) -> bool {
    sqlstate(err).is_some_and(|code| code == SERIALIZATION_FAILURE || code == DEADLOCK_DETECTED)
}

/// Whether `err` is a [`StoreError::Unavailable`] caused by a serialization
/// failure or a deadlock (what the store's retry helper retries).
pub(crate) fn is_conflict_store_error(err: &StoreError) -> bool {
    match err {
        StoreError::Unavailable(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(is_conflict),
        _ => false,
    }
}

/// The connection broke or the server is going away: class 08
/// (connection exception), 57P01-57P03 (admin/crash shutdown, cannot
/// connect now), or an I/O error.
pub(crate) fn is_connection_lost(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Protocol(_) => true,
        _ => sqlstate(err).is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
    }
}

/// No connection in time, too many connections, resources exhausted, a
/// lock not granted in time, or a statement cancelled (`57014`: the
/// store's `statement_timeout`).
fn is_overloaded(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::PoolTimedOut)
        || sqlstate(err)
            .is_some_and(|code| code.starts_with("53") || code == "55P03" || code == "57014")
}

fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

pub(crate) use keel_sql::error::sql_limit;

#[cfg(test)]
mod tests {
    use keel_core::{Classify, ErrorClass};

    use super::*;

    #[test]
    fn io_during_commit_is_outcome_unknown() {
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        let err = commit_error(sqlx::Error::Io(io));
        assert_eq!(err.class(), ErrorClass::OutcomeUnknown);
    }

    #[test]
    fn io_in_a_statement_is_retryable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(db_error(sqlx::Error::Io(io)).class(), ErrorClass::Retryable);
        assert_eq!(
            db_error(sqlx::Error::PoolTimedOut).class(),
            ErrorClass::Retryable
        );
    }

    /// A single write in autocommit commits by itself: a connection lost
    /// before its answer came may have lost the answer to a commit. Before,
    /// it was "unavailable, nothing committed", and a caller retrying a
    /// non-idempotent write, or telling its client nothing happened, lied.
    #[test]
    fn an_autocommit_write_that_lost_its_answer_is_outcome_unknown() {
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let lost = autocommit_write_error(db_error(sqlx::Error::Io(reset)));
        assert_eq!(lost.class(), ErrorClass::OutcomeUnknown);
        let never_sent = autocommit_write_error(db_error(sqlx::Error::PoolTimedOut));
        assert_eq!(never_sent.class(), ErrorClass::Retryable);
    }

    #[test]
    fn an_unexpected_database_answer_is_unclassified_never_retried() {
        let err = db_error(sqlx::Error::RowNotFound);
        assert_eq!(err.class(), ErrorClass::Unclassified);
        assert!(
            err.class().is_dependency_failure(),
            "it counts against the database"
        );
        assert!(!is_conflict_store_error(&err));
    }
}
