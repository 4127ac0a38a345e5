//! Fencing tokens.
//!
//! One atomic upsert per token: the row for the resource is created at 1 or
//! incremented under its row lock, and the new value returned, so concurrent
//! callers never see the same token, and the committed row keeps tokens
//! growing across restarts and power losses (SQLite's `synchronous = FULL`,
//! PostgreSQL's commit). A token whose autocommit was lost is simply never
//! used: the next one is still greater.

use keel_store::StoreError;

use crate::backend::SqlBackend;
use crate::dialect::{Dialect, SqlRow};
use crate::error::{corrupt, to_u64};
use crate::retry::retry;

const NEXT_SQL: &str = "\
INSERT INTO keel_fences (resource, last_token) VALUES ($1, 1)
ON CONFLICT (resource) DO UPDATE SET last_token = keel_fences.last_token + 1
RETURNING last_token";

/// [`FenceStore::fence_next`](keel_store::FenceStore::fence_next).
pub async fn next<B: SqlBackend>(store: &B, resource: &str) -> Result<u64, StoreError> {
    let params = [resource.into()];
    let row =
        retry::<B::Dialect, _, _, _>("fence_next", || store.write_optional(NEXT_SQL, &params))
            .await?
            .ok_or_else(|| {
                corrupt(
                    B::Dialect::NAME,
                    "fencing token",
                    "the upsert returned no row",
                )
            })?;
    to_u64("fencing token", row.int("last_token")?)
}

/// Implements [`FenceStore`](keel_store::FenceStore) for a
/// [`SqlBackend`] with the core's [`next`].
#[macro_export]
macro_rules! fence_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::FenceStore for $store {
            async fn fence_next(
                &self,
                resource: &str,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::fence::next(self, resource).await
            }
        }
    };
}
