//! Fencing tokens on PostgreSQL.
//!
//! One atomic upsert per token: the row for the resource is created at 1 or
//! incremented under its row lock, and the new value returned, so concurrent
//! callers never see the same token, and the committed row keeps tokens
//! growing across restarts. A token whose autocommit was lost is simply
//! never used: the next one is still greater.

use async_trait::async_trait;
use keel_messaging::StoreError;
use keel_messaging::store::FenceStore;

use super::PgStore;
use super::error::{db_error, to_u64};
use super::retry::retry;

const NEXT_SQL: &str = "\
INSERT INTO keel_fences (resource, last_token) VALUES ($1, 1)
ON CONFLICT (resource) DO UPDATE SET last_token = keel_fences.last_token + 1
RETURNING last_token";

#[async_trait]
impl FenceStore for PgStore {
    async fn fence_next(&self, resource: &str) -> Result<u64, StoreError> {
        let token: i64 = retry("fence_next", || async {
            sqlx::query_scalar(NEXT_SQL)
                .bind(resource)
                .fetch_one(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        to_u64("fencing token", token)
    }
}
