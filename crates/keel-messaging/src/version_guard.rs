//! The entity version guard: drop an event that is older than what was
//! already applied.
//!
//! Per-key order keeps an entity's events in sequence on one partition,
//! but not everywhere: a replay from the dead-letter store, a webhook, a
//! consumer reading several partitions, or a producer that publishes from
//! two places can deliver `order.refunded` before the `order.paid` it
//! refunds. The inbox does not help: both are new ids. What helps is the
//! envelope's `data.version`, monotonic per entity (`subject`): a consumer
//! that records the newest version it applied can tell a late event from a
//! new one, and drop it instead of letting it overwrite newer state.
//!
//! The check is one conditional upsert in the handler's own transaction
//! ([`EntityVersionStore::entity_version_advance`]), so the recorded
//! version commits with the effect or not at all, and two deliveries of
//! one entity racing in two processes serialize on its row: the newer wins
//! whatever the order in which they arrive. An event with the version
//! already applied is stale too: it is the same state again.
//!
//! ```no_run
//! use keel_messaging::envelope::Envelope;
//! use keel_messaging::store::EntityVersionStore;
//! use keel_messaging::version_guard::{Freshness, VersionGuard};
//!
//! # async fn handle<S: EntityVersionStore>(store: S, event: Envelope) -> Result<(), Box<dyn std::error::Error>> {
//! let guard = VersionGuard::new(store.clone(), "order-projection");
//! let mut tx = store.begin().await?;
//! if guard.admit(&mut tx, &event).await? == Freshness::Newer {
//!     // apply the event's state in `tx`
//! }
//! store.commit(tx).await?;
//! # Ok(()) }
//! ```

use crate::envelope::Envelope;
use crate::store::{EntityVersionStore, StoreError};

/// Whether an event is newer than what its scope applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Newer: apply it (the version is recorded in the transaction).
    Newer,
    /// The same version or an older one: drop it; nothing was recorded.
    Stale,
}

/// The guard could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionGuardError {
    /// The event names no entity or carries no version, so it cannot be
    /// ordered; a producer must set `subject` and `data.version`
    /// ([`EventMeta`](crate::envelope::EventMeta) does).
    #[error("event {id} has no {missing}: it cannot be ordered against its entity's other events")]
    Unversioned {
        /// The event id.
        id: String,
        /// `subject` or `data.version`.
        missing: &'static str,
    },
    /// The store failed; see [`StoreError`] for whether to retry.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl keel_core::Classify for VersionGuardError {
    fn class(&self) -> keel_core::ErrorClass {
        match self {
            Self::Unversioned { .. } => keel_core::ErrorClass::Permanent,
            Self::Store(err) => err.class(),
        }
    }
}

/// Drops events older than what one scope (a handler, a projection) has
/// applied. Cheap to clone.
#[derive(Debug, Clone)]
pub struct VersionGuard<S> {
    store: S,
    scope: String,
}

impl<S: EntityVersionStore> VersionGuard<S> {
    /// A guard over `store` for `scope`: two consumers of the same entity
    /// need two scopes, each with the versions it applied.
    pub fn new(store: S, scope: impl Into<String>) -> Self {
        Self {
            store,
            scope: scope.into(),
        }
    }

    /// Whether `event` is newer than its entity's applied version, from
    /// its `subject` and `data.version`; if so, its version is recorded in
    /// `tx`.
    pub async fn admit(
        &self,
        tx: &mut S::Tx,
        event: &Envelope,
    ) -> Result<Freshness, VersionGuardError> {
        let unversioned = |missing| VersionGuardError::Unversioned {
            id: event.id.clone(),
            missing,
        };
        let entity = event
            .subject
            .as_deref()
            .ok_or_else(|| unversioned("subject"))?;
        let version = event.version().ok_or_else(|| unversioned("data.version"))?;
        Ok(self.admit_version(tx, entity, version).await?)
    }

    /// [`admit`](Self::admit) for an entity and version read elsewhere (a
    /// header, a webhook's sequence number).
    pub async fn admit_version(
        &self,
        tx: &mut S::Tx,
        entity: &str,
        version: u64,
    ) -> Result<Freshness, StoreError> {
        let newer = self
            .store
            .entity_version_advance(tx, &self.scope, entity, version)
            .await?;
        if newer {
            return Ok(Freshness::Newer);
        }
        metrics::counter!("keel_events_stale_total", "scope" => self.scope.clone()).increment(1);
        tracing::debug!(scope = %self.scope, entity, version, "stale event dropped");
        Ok(Freshness::Stale)
    }

    /// The version applied for `entity`, if any.
    pub async fn applied(&self, entity: &str) -> Result<Option<u64>, StoreError> {
        self.store.entity_version_get(&self.scope, entity).await
    }
}
