//! Running the store's own transactions again after a serialization failure
//! or a deadlock, and resolving a `COMMIT` whose connection was lost.
//!
//! PostgreSQL resolves a deadlock by aborting one of the transactions
//! (`40P01`) and a conflict under `REPEATABLE READ`/`SERIALIZABLE` by
//! aborting with `40001`; in both cases nothing was written and the whole
//! transaction must run again. [`retry`] does that for the statements and
//! transactions the store runs itself, with the shared core's jittered
//! backoff. A
//! user's transaction is theirs to re-run: its errors are only classified
//! ([`StoreError::Unavailable`], retryable).
//!
//! A lost connection during `COMMIT` is not retried blindly: the store asks
//! PostgreSQL, on a fresh connection, what became of the transaction id
//! (`txid_status`), which is exactly the question "did it commit?".

use std::future::Future;

use keel_messaging::StoreError;

use super::PgDialect;

/// Runs `op` until it succeeds, fails with something other than a
/// serialization failure or deadlock, or has been retried
/// [`keel_sql::retry::MAX_RETRIES`] times (the core's loop, with
/// PostgreSQL's classification).
pub(crate) async fn retry<T, F, Fut>(what: &'static str, op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    keel_sql::retry::retry::<PgDialect, _, _, _>(what, op).await
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Retryable, but not a conflict: the caller's retry policy decides.
    fn pool_timeout() -> StoreError {
        StoreError::Unavailable(sqlx::Error::PoolTimedOut.into())
    }

    #[tokio::test(start_paused = true)]
    async fn only_conflicts_are_retried() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let result: Result<(), _> = retry("test", || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Err(pool_timeout()) }
        })
        .await;
        assert!(result.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
