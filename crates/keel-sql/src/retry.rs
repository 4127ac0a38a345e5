//! Running the store's own statements again after a conflict.
//!
//! PostgreSQL resolves a deadlock by aborting one of the transactions
//! (`40P01`) and a conflict under `REPEATABLE READ`/`SERIALIZABLE` by
//! aborting with `40001`; in both cases nothing was written and the whole
//! statement or transaction must run again. [`retry`] does that for what the
//! store runs itself, with a short jittered backoff, for every dialect: the
//! dialect only says which errors qualify ([`Dialect::retries`]). SQLite
//! says none: its `BUSY` comes after the busy timeout already waited, and
//! retrying would only multiply the wait. A user's transaction is theirs to
//! re-run.

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use keel_policy::retry::{Backoff, Jitter};
use keel_store::StoreError;

use crate::backend::SqlBackend;
use crate::dialect::{Dialect, Value};
use crate::error::sql_limit;

/// How many times an operation runs again after a conflict.
pub const MAX_RETRIES: u32 = 6;
/// The first backoff cap; it doubles per retry (equal jitter, see
/// [`backoff`]).
pub const BASE_DELAY: Duration = Duration::from_millis(4);

/// [`BASE_DELAY`] × 2ⁿ, at most 1024 × [`BASE_DELAY`], equal jitter.
static BACKOFF: LazyLock<Backoff> = LazyLock::new(|| {
    Backoff::exponential(BASE_DELAY, 2.0, BASE_DELAY * 1024)
        .and_then(|backoff| backoff.with_jitter(Jitter::Equal))
        .expect("a valid constant backoff")
});

/// Runs `op` until it succeeds, fails with an error `D` does not retry, or
/// has been retried [`MAX_RETRIES`] times.
pub async fn retry<D, T, F, Fut>(what: &'static str, mut op: F) -> Result<T, StoreError>
where
    D: Dialect,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut retries = 0;
    loop {
        match op().await {
            Err(err) if retries < MAX_RETRIES && D::retries(&err) => {
                retries += 1;
                metrics::counter!("keel_store_conflict_retries_total", "op" => what, "db" => D::NAME)
                    .increment(1);
                tracing::debug!(op = what, db = D::NAME, retries, error = %err, "store conflict; retrying");
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
pub fn backoff(retries: u32) -> Duration {
    BACKOFF
        .delay(retries.saturating_sub(1))
        .unwrap_or(BASE_DELAY)
}

/// A write outside a transaction, retried like all of the store's own.
pub async fn write<B: SqlBackend>(
    store: &B,
    what: &'static str,
    sql: &str,
    params: &[Value<'_>],
) -> Result<u64, StoreError> {
    retry::<B::Dialect, _, _, _>(what, || store.write(sql, params)).await
}

/// The statement of one bounded delete: the first `$2` rows of `table`, by
/// `order`, that match `condition` (on the cut-off `$1`), each named by
/// its `key` columns (one, or several such as `event_id, handler`),
/// skipping rows another writer holds ([`Dialect::skip_locked`]).
pub fn bounded_delete_sql<D: Dialect>(
    table: &str,
    key: &str,
    condition: &str,
    order: &str,
) -> String {
    format!(
        "DELETE FROM {table} WHERE ({key}) IN (
           SELECT {key} FROM {table} WHERE {condition} ORDER BY {order} LIMIT $2{})",
        D::skip_locked(None)
    )
}

/// Runs one bounded delete ([`bounded_delete_sql`]), `sql` with the cut-off as `$1` and the batch
/// size as `$2`; returns how many rows went (none when `batch` is 0). Every
/// prune and trim is one of these, so none holds locks for longer than one
/// small batch.
pub async fn delete_batch<B: SqlBackend>(
    store: &B,
    what: &'static str,
    sql: &str,
    cut_off: Value<'_>,
    batch: usize,
) -> Result<u64, StoreError> {
    if batch == 0 {
        return Ok(0);
    }
    let deleted = write(store, what, sql, &[cut_off, sql_limit(batch).into()]).await?;
    if deleted > 0 {
        tracing::debug!(deleted, what, "pruned");
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for retries in 1..20 {
            let delay = backoff(retries);
            assert!(delay <= BASE_DELAY * 1024, "{delay:?}");
        }
        assert!(backoff(1) <= BASE_DELAY);
        assert!(backoff(1) >= BASE_DELAY / 2);
    }
}
