//! The inbox table: which message ids a consumer group has already
//! applied, recorded in the same transaction as the effect.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{Store, StoreError};

/// The idempotent consumer's table of processed events.
#[async_trait]
pub trait InboxStore: Store {
    /// Records that `handler` processed `event_id`, inside the transaction of
    /// its effect. `false` if it already had: the caller skips the effect.
    async fn inbox_record(
        &self,
        tx: &mut Self::Tx,
        event_id: &str,
        handler: &str,
    ) -> Result<bool, StoreError>;

    /// Deletes inbox rows older than `before` (beyond any redelivery window).
    async fn inbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}
