//! The storage contract: the tables the messaging patterns need.
//!
//! The user's own database transaction is the unit of work. A [`Store`] hands
//! out its backend's transaction type ([`Store::Tx`], e.g.
//! `sqlx::Transaction<'static, Postgres>`, or SQLite's group-committed
//! `WriteTx`, both lending their connection to `&mut *tx`), the user writes
//! business rows in it with their own SQL, and Keel adds its rows to the *same* transaction: the
//! outbox row commits with the order, the inbox row commits with the effect.
//! That is the whole trick of both patterns, so it is in the type signatures.
//!
//! Each capability is its own trait so a backend can be tested (and a user
//! can depend) capability by capability; [`MessagingStore`] is all of them.
//! `keel-sqlite` and `keel-postgres` implement them; `keel-testkit` holds the
//! conformance suite that defines their behaviour.

mod batches;
mod dead_letter;
mod entity_version;
mod event_log;
mod fence;
mod idempotency;
mod inbox;
mod jobs;
mod lease;
mod outbox;
mod saga;
mod webhooks;

pub use batches::delete_in_batches;
pub use dead_letter::*;
pub use entity_version::*;
pub use event_log::*;
pub use fence::*;
pub use idempotency::*;
pub use inbox::*;
pub use jobs::*;
pub use lease::*;
pub use outbox::*;
pub use saga::*;
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
pub trait MessagingStore:
    OutboxStore
    + InboxStore
    + DeadLetterStore
    + SagaStore
    + FenceStore
    + EntityVersionStore
    + LeaseStore
{
}

impl<S> MessagingStore for S where
    S: OutboxStore
        + InboxStore
        + DeadLetterStore
        + SagaStore
        + FenceStore
        + EntityVersionStore
        + LeaseStore
{
}
