//! Deleting expired keys, once or on a schedule.

use std::time::Duration;

use keel_store::StoreError;
use keel_store::{IdempotencyStore, delete_in_batches};
use tokio::task::JoinHandle;

use super::service::wall_now;

/// Keys deleted per statement by [`prune_expired`]: 1,000. Small batches
/// keep each delete short, so requests waiting for the write lock are not
/// held up.
pub const DEFAULT_PRUNE_BATCH: usize = 1000;

/// How often [`spawn_pruner`] runs by default: every 10 minutes.
pub const DEFAULT_PRUNE_INTERVAL: Duration = Duration::from_secs(10 * 60);

/// Deletes every key that has expired, `batch` at a time (at least 1);
/// returns how many.
pub async fn prune_expired<S: IdempotencyStore>(
    store: &S,
    batch: usize,
) -> Result<u64, StoreError> {
    let batch = batch.max(1);
    let now = wall_now();
    let total = delete_in_batches(batch, || store.idempotency_prune(now, batch)).await?;
    if total > 0 {
        metrics::counter!("keel_idempotency_pruned_total").increment(total);
        tracing::debug!(deleted = total, "expired idempotency keys pruned");
    }
    Ok(total)
}

/// Runs [`prune_expired`] every `every` (tokio's clock) until the returned
/// task is aborted. Failures are logged and retried at the next tick.
pub fn spawn_pruner<S: IdempotencyStore>(store: S, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        keel_core::clock::every(every, std::future::pending(), || async {
            if let Err(err) = prune_expired(&store, DEFAULT_PRUNE_BATCH).await {
                metrics::counter!("keel_idempotency_store_errors_total").increment(1);
                tracing::warn!(error = %err, "pruning idempotency keys failed; retrying next tick");
            }
        })
        .await;
    })
}
