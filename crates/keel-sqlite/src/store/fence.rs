//! Fencing tokens on SQLite.
//!
//! One atomic upsert per token: the row for the resource is created at 1 or
//! incremented, and the new value returned, so concurrent callers can never
//! see the same token. The row is durable (`synchronous = FULL` by default),
//! so tokens keep growing across restarts and power losses.

use async_trait::async_trait;
use keel_messaging::StoreError;
use keel_messaging::store::FenceStore;

use super::SqliteStore;
use super::error::{db_error, to_u64};

const NEXT_SQL: &str = "\
INSERT INTO keel_fences (resource, last_token) VALUES (?1, 1)
ON CONFLICT (resource) DO UPDATE SET last_token = last_token + 1
RETURNING last_token";

#[async_trait]
impl FenceStore for SqliteStore {
    async fn fence_next(&self, resource: &str) -> Result<u64, StoreError> {
        let token: i64 = sqlx::query_scalar(NEXT_SQL)
            .bind(resource)
            .fetch_one(&self.writer)
            .await
            .map_err(db_error)?;
        to_u64("fencing token", token)
    }
}
