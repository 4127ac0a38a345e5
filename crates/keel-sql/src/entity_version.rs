//! Entity versions, for the version guard.
//!
//! One conditional upsert: the row is created, or raised under its row
//! lock only when the new version is higher, and a row comes back only if
//! something was written. Two transactions advancing one entity serialize
//! on that lock (PostgreSQL re-checks the condition against the committed
//! row; SQLite has one writer), so a stale event never wins a race.

use keel_store::StoreError;

use crate::backend::{SqlBackend, Tx};
use crate::dialect::{Dialect, Exec, SqlRow};
use crate::error::to_u64;

const ADVANCE_SQL: &str = "\
INSERT INTO keel_entity_versions (scope, entity, version) VALUES ($1, $2, $3)
ON CONFLICT (scope, entity) DO UPDATE SET version = excluded.version
 WHERE keel_entity_versions.version < excluded.version
RETURNING version";

const GET_SQL: &str = "SELECT version FROM keel_entity_versions WHERE scope = $1 AND entity = $2";

/// [`EntityVersionStore::entity_version_advance`](keel_store::EntityVersionStore::entity_version_advance).
pub async fn advance<B: SqlBackend>(
    tx: &mut Tx<B>,
    scope: &str,
    entity: &str,
    version: u64,
) -> Result<bool, StoreError> {
    let version = i64::try_from(version)
        .map_err(|_| StoreError::other(format!("entity version {version} is over i64::MAX")))?;
    let params = [scope.into(), entity.into(), version.into()];
    let row = B::Dialect::fetch_optional(Exec::Tx(tx), ADVANCE_SQL, &params).await?;
    Ok(row.is_some())
}

/// [`EntityVersionStore::entity_version_get`](keel_store::EntityVersionStore::entity_version_get).
pub async fn get<B: SqlBackend>(
    store: &B,
    scope: &str,
    entity: &str,
) -> Result<Option<u64>, StoreError> {
    let row = store
        .read_optional(GET_SQL, &[scope.into(), entity.into()])
        .await?;
    row.map(|row| to_u64("entity version", row.int("version")?))
        .transpose()
}

/// Implements [`EntityVersionStore`](keel_store::EntityVersionStore)
/// for a [`SqlBackend`] whose transaction is the core's [`Tx`].
#[macro_export]
macro_rules! entity_version_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::EntityVersionStore for $store {
            async fn entity_version_advance(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                scope: &str,
                entity: &str,
                version: u64,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::entity_version::advance::<Self>(tx, scope, entity, version).await
            }

            async fn entity_version_get(
                &self,
                scope: &str,
                entity: &str,
            ) -> ::std::result::Result<::std::option::Option<u64>, $crate::__private::StoreError>
            {
                $crate::entity_version::get(self, scope, entity).await
            }
        }
    };
}
