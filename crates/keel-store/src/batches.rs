//! Deleting in bounded batches: what every prune and trim does.

use std::future::Future;

use super::StoreError;

/// Runs `delete` (one statement removing at most `batch` rows, returning
/// how many it removed) again until a batch comes back short; returns the
/// rows removed in all. Each batch is short, so a prune never holds the
/// write lock for long, and the task yields between batches so a large
/// backlog does not starve the others on its thread.
pub async fn delete_in_batches<F, Fut>(batch: usize, mut delete: F) -> Result<u64, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let full = u64::try_from(batch).unwrap_or(u64::MAX);
    let mut total = 0;
    loop {
        let deleted = delete().await?;
        total += deleted;
        if deleted < full {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stops_at_the_first_short_batch() {
        let mut left = 7u64;
        let total = delete_in_batches(3, || {
            let n = left.min(3);
            left -= n;
            async move { Ok(n) }
        })
        .await
        .unwrap();
        assert_eq!((total, left), (7, 0));
        let mut calls = 0;
        let none = delete_in_batches(3, || {
            calls += 1;
            async { Ok(0) }
        })
        .await
        .unwrap();
        assert_eq!((none, calls), (0, 1));
    }
}
