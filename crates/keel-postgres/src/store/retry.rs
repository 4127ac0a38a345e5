//! Running the store's own transactions again after a serialization failure
//! or a deadlock, and resolving a `COMMIT` whose connection was lost.
//!
//! PostgreSQL resolves a deadlock by aborting one of the transactions
//! (`40P01`) and a conflict under `REPEATABLE READ`/`SERIALIZABLE` by
//! aborting with `40001`; in both cases nothing was written and the whole
//! transaction must run again. [`retry`] does that for the statements and
//! transactions the store runs itself, with a short jittered backoff. A
//! user's transaction is theirs to re-run: its errors are only classified
//! ([`StoreError::Unavailable`], retryable).
//!
//! A lost connection during `COMMIT` is not retried blindly: the store asks
//! PostgreSQL, on a fresh connection, what became of the transaction id
//! (`txid_status`), which is exactly the question "did it commit?".

use std::future::Future;
use std::time::Duration;

use keel_messaging::StoreError;

use super::error::is_conflict_store_error;

/// How many times an operation runs again after a conflict.
const MAX_RETRIES: u32 = 6;
/// The first backoff cap; it doubles per retry (equal jitter, see
/// `backoff`).
const BASE_DELAY: Duration = Duration::from_millis(4);

/// Runs `op` until it succeeds, fails with something other than a
/// serialization failure or deadlock, or has been retried [`MAX_RETRIES`]
/// times.
pub(crate) async fn retry<T, F, Fut>(what: &'static str, mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut retries = 0;
    loop {
        match op().await {
            Err(err) if retries < MAX_RETRIES && is_conflict_store_error(&err) => {
                retries += 1;
                metrics::counter!("keel_postgres_conflict_retries_total", "op" => what)
                    .increment(1);
                tracing::debug!(op = what, retries, error = %err, "postgres conflict; retrying");
                tokio::time::sleep(backoff(retries)).await;
            }
            other => return other,
        }
    }
}

/// The delay before retry number `retries` (from 1): uniformly random
/// between half of `BASE_DELAY * 2^(retries-1)` and all of it ("equal
/// jitter"), so colliding transactions spread out yet each waits at least
/// half the cap.
pub(crate) fn backoff(retries: u32) -> Duration {
    let cap = BASE_DELAY.saturating_mul(1 << retries.saturating_sub(1).min(10));
    let cap_us = u64::try_from(cap.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(fastrand::u64(cap_us / 2..=cap_us))
}

/// Runs one bounded delete, `sql` with the cut-off as `$1` and the batch
/// size as `$2`, retried like any of the store's own statements; returns how
/// many rows went (none when `batch` is 0). Every prune and trim is one of
/// these, so none holds locks for longer than one small batch.
pub(crate) async fn delete_batch<T>(
    pool: &sqlx::PgPool,
    what: &'static str,
    sql: &'static str,
    cut_off: T,
    batch: usize,
) -> Result<u64, StoreError>
where
    T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Clone + Send,
{
    if batch == 0 {
        return Ok(0);
    }
    let done = retry(what, || async {
        sqlx::query(sql)
            .bind(cut_off.clone())
            .bind(super::error::sql_limit(batch))
            .execute(pool)
            .await
            .map_err(super::error::db_error)
    })
    .await?;
    let deleted = done.rows_affected();
    if deleted > 0 {
        tracing::debug!(deleted, what, "pruned");
    }
    Ok(deleted)
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

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for retries in 1..20 {
            let delay = backoff(retries);
            assert!(delay <= BASE_DELAY * 1024, "{delay:?}");
        }
        assert!(backoff(1) <= BASE_DELAY);
    }
}
