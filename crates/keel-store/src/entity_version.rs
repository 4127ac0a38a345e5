//! Entity versions: the newest version of each entity a consumer applied.

use async_trait::async_trait;

use super::{Store, StoreError};

/// The version guard's table: per `(scope, entity)`, the highest version
/// applied. A scope is one consumer's view (a handler, a projection), so
/// two consumers of the same entity keep their own versions.
#[async_trait]
pub trait EntityVersionStore: Store {
    /// Records, in the caller's transaction, that `entity` is now at
    /// `version` in `scope`, if that is newer than what is recorded:
    /// `true` then, `false` (nothing written) if the recorded version is
    /// the same or newer. A second transaction advancing the same entity
    /// waits for the first and then sees its version.
    async fn entity_version_advance(
        &self,
        tx: &mut Self::Tx,
        scope: &str,
        entity: &str,
        version: u64,
    ) -> Result<bool, StoreError>;

    /// The version recorded for `entity` in `scope`, if any.
    async fn entity_version_get(
        &self,
        scope: &str,
        entity: &str,
    ) -> Result<Option<u64>, StoreError>;
}
