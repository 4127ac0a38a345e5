//! The contracts a database and a broker fulfil for Keel: the tables the
//! messaging patterns and the HTTP edge need, the [`broker`] trait, and the
//! CloudEvents [`envelope`] that crosses it.
//!
//! This crate is an API, like restate's storage-api: no runtime, no
//! backend. The runtimes (`keel-messaging`'s relay, consumer and sagas;
//! `keel-http`'s idempotency keys and jobs; `keel-webhooks`; `keel-realtime`)
//! are written against these traits, and the backends (`keel-sqlite`, the
//! embedded default; `keel-postgres`; `keel-nats`) implement them without
//! compiling any runtime. A new backend depends on this crate alone. It may
//! depend on `keel-core` and nothing else of Keel's.
//!
//! The user's own database transaction is the unit of work. A [`Store`]
//! hands out its backend's transaction type ([`Store::Tx`], e.g.
//! `sqlx::Transaction<'static, Postgres>`, or SQLite's group-committed
//! `WriteTx`, both lending their connection to `&mut *tx`), the user writes
//! business rows in it with their own SQL, and Keel adds its rows to the
//! *same* transaction: the outbox row commits with the order, the inbox row
//! commits with the effect. That is the whole trick of both patterns, so it
//! is in the type signatures.
//!
//! Each table is its own trait behind its own cargo feature, so a backend
//! can be built and tested (and a user can depend) table by table:
//!
//! | feature | trait | used by |
//! |---|---|---|
//! | `outbox` | [`OutboxStore`], [`OutboxAdminStore`] | the relay; operators |
//! | `inbox` | [`InboxStore`] | idempotent consumers |
//! | `dead-letter` | [`DeadLetterStore`] | consumers, and operators |
//! | `saga` | [`SagaStore`] | the saga orchestrator |
//! | `fence` | [`FenceStore`] | resources that check fencing tokens |
//! | `entity-version` | [`EntityVersionStore`] | version guards |
//! | `lease` | [`LeaseStore`] | leases and leader election |
//! | `idempotency` | [`IdempotencyStore`] | the HTTP edge's idempotency keys |
//! | `jobs` | [`JobStore`] | the HTTP edge's async jobs |
//! | `event-log` | [`EventLogStore`] | realtime streams' replay |
//! | `webhooks` | [`WebhookEndpointStore`], [`WebhookDeliveryStore`], [`WebhookLogStore`] ([`WebhookStore`], their sum) | management; the sender and workers; the delivery log |
//! | `shared-dedup` | [`SharedDedupStore`] | consumers whose effect has no transaction (Redis) |
//! | `election` | [`Election`], [`Leadership`] | leader election: on leases (any [`LeaseStore`] backend), on etcd |
//!
//! `messaging` turns on the first seven, which [`MessagingStore`] bounds
//! together. `keel-testkit` holds the conformance suite that defines what
//! every implementation must do.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod batches;
pub mod broker;
pub mod dedup;
pub mod envelope;

#[cfg(feature = "dead-letter")]
mod dead_letter;
#[cfg(feature = "election")]
mod election;
#[cfg(feature = "entity-version")]
mod entity_version;
#[cfg(feature = "event-log")]
mod event_log;
#[cfg(feature = "fence")]
mod fence;
#[cfg(feature = "idempotency")]
mod idempotency;
#[cfg(feature = "inbox")]
mod inbox;
#[cfg(feature = "jobs")]
mod jobs;
#[cfg(feature = "lease")]
mod lease;
#[cfg(feature = "outbox")]
mod outbox;
#[cfg(feature = "saga")]
mod saga;
#[cfg(feature = "shared-dedup")]
mod shared_dedup;
#[cfg(feature = "webhooks")]
mod webhooks;

pub use batches::delete_in_batches;
pub use broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};
pub use dedup::DedupWindow;
pub use envelope::{Envelope, Event, EventMeta};

#[cfg(feature = "dead-letter")]
pub use dead_letter::*;
#[cfg(feature = "election")]
pub use election::*;
#[cfg(feature = "entity-version")]
pub use entity_version::*;
#[cfg(feature = "event-log")]
pub use event_log::*;
#[cfg(feature = "fence")]
pub use fence::*;
#[cfg(feature = "idempotency")]
pub use idempotency::*;
#[cfg(feature = "inbox")]
pub use inbox::*;
#[cfg(feature = "jobs")]
pub use jobs::*;
#[cfg(feature = "lease")]
pub use lease::*;
#[cfg(feature = "outbox")]
pub use outbox::*;
#[cfg(feature = "saga")]
pub use saga::*;
#[cfg(feature = "shared-dedup")]
pub use shared_dedup::*;
#[cfg(feature = "webhooks")]
pub use webhooks::*;

use async_trait::async_trait;
use keel_core::{BoxError, Classify, ErrorClass};

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached, or asked us to retry (busy,
    /// serialization failure, deadlock). Nothing was committed.
    #[error("store unavailable, try again: {0}")]
    Unavailable(#[source] BoxError),
    /// The connection failed during COMMIT: the transaction may or may not
    /// have committed. Resolve by reading back, never by guessing.
    #[error("store commit outcome unknown: {0}")]
    OutcomeUnknown(#[source] BoxError),
    /// A uniqueness or version check failed.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The row does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// Anything else (a bug, a schema mismatch).
    #[error("store error: {0}")]
    Other(#[source] BoxError),
}

impl StoreError {
    /// Wraps any error as [`StoreError::Other`].
    pub fn other(err: impl Into<BoxError>) -> Self {
        Self::Other(err.into())
    }
}

impl Classify for StoreError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Unavailable(_) => ErrorClass::Retryable,
            Self::OutcomeUnknown(_) => ErrorClass::OutcomeUnknown,
            Self::Conflict(_) | Self::NotFound(_) => ErrorClass::Permanent,
            // Nobody said what kind of failure it is: it counts against the
            // dependency (breakers) and is not retried.
            Self::Other(_) => ErrorClass::Unclassified,
        }
    }
}

/// A database that can run transactions.
#[async_trait]
pub trait Store: Clone + Send + Sync + 'static {
    /// The backend's transaction, in which users write their own rows too.
    type Tx: Send;

    /// Starts a transaction.
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Commits a transaction. [`StoreError::OutcomeUnknown`] when the
    /// connection failed during COMMIT.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls a transaction back, and answers only once every row the
    /// transaction could read is as durable as a commit of the store is
    /// (on SQLite, at its `synchronous` setting): a caller may act on what
    /// it read (ack a duplicate, replay a stored answer) when this returns
    /// `Ok`.
    /// An error means what it read may not survive: read again.
    ///
    /// Dropping a transaction rolls it back too, but answers nobody.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Whether the schema is migrated and the pool is usable (`/readyz`).
    async fn ready(&self) -> Result<(), StoreError>;
}

/// Every messaging capability in one bound.
#[cfg(feature = "messaging")]
pub trait MessagingStore:
    OutboxStore
    + OutboxAdminStore
    + InboxStore
    + DeadLetterStore
    + SagaStore
    + FenceStore
    + EntityVersionStore
    + LeaseStore
{
}

#[cfg(feature = "messaging")]
impl<S> MessagingStore for S where
    S: OutboxStore
        + OutboxAdminStore
        + InboxStore
        + DeadLetterStore
        + SagaStore
        + FenceStore
        + EntityVersionStore
        + LeaseStore
{
}
