//! Turning SQLite failures into [`BrokerError`]s a caller can act on.

use std::error::Error as StdError;

use keel_store::broker::BrokerError;

/// A database operation of the broker failed; `operation` says which.
#[derive(Debug, thiserror::Error)]
#[error("sqlite broker: {operation} failed: {source}")]
pub(super) struct DbFailure {
    operation: &'static str,
    #[source]
    source: sqlx::Error,
}

/// Maps a sqlx error: a busy or locked database, I/O trouble and pool
/// timeouts are worth retrying ([`BrokerError::Unavailable`]); the rest is
/// [`BrokerError::Other`].
pub(super) fn db_error(operation: &'static str, source: sqlx::Error) -> BrokerError {
    let transient = is_transient(&source);
    let failure = Box::new(DbFailure { operation, source });
    if transient {
        BrokerError::Unavailable(failure)
    } else {
        BrokerError::Other(failure)
    }
}

fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|code| code.parse::<i64>().ok())
            // SQLITE_BUSY, SQLITE_LOCKED, SQLITE_IOERR, SQLITE_FULL,
            // SQLITE_CANTOPEN (primary codes; extended codes share the low byte).
            .is_some_and(|code| matches!(code & 0xff, 5 | 6 | 10 | 13 | 14)),
        _ => false,
    }
}

/// A copy of `error` for another waiter of the same failed batch: same
/// variant, same message (errors are not `Clone`).
pub(super) fn replicate(error: &BrokerError) -> BrokerError {
    let message = || -> Box<dyn StdError + Send + Sync> {
        match StdError::source(error) {
            Some(source) => source.to_string().into(),
            None => error.to_string().into(),
        }
    };
    match error {
        BrokerError::Unavailable(_) => BrokerError::Unavailable(message()),
        BrokerError::OutcomeUnknown(_) => BrokerError::OutcomeUnknown(message()),
        BrokerError::LeaseLost => BrokerError::LeaseLost,
        BrokerError::Invalid(reason) => BrokerError::Invalid(reason.clone()),
        _ => BrokerError::Other(message()),
    }
}

#[cfg(test)]
mod tests {
    use keel_core::{Classify, ErrorClass};

    use super::*;

    #[test]
    fn pool_timeouts_are_retryable_and_protocol_errors_are_not() {
        assert_eq!(
            db_error("receive", sqlx::Error::PoolTimedOut).class(),
            ErrorClass::Retryable
        );
        let other = db_error("receive", sqlx::Error::Protocol("bad".into()));
        assert_eq!(
            other.class(),
            ErrorClass::Unclassified,
            "a failure, never retried"
        );
        assert!(other.to_string().contains("receive failed"), "{other}");
    }

    #[test]
    fn replicas_keep_the_class_and_the_message() {
        let original = db_error("ack", sqlx::Error::PoolTimedOut);
        let copy = replicate(&original);
        assert_eq!(copy.class(), original.class());
        assert_eq!(
            StdError::source(&copy).map(ToString::to_string),
            StdError::source(&original).map(ToString::to_string)
        );
    }
}
