//! The outbox table: rows appended in the caller's transaction, claimed
//! by relays under a lease, published, and parked when the broker refuses
//! them for good.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};
use crate::broker::{Headers, Message};

/// An event to put in the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The event id; unique in the outbox, and the message id.
    pub event_id: String,
    /// The destination topic.
    pub topic: String,
    /// Keeps per-entity order on the broker.
    pub partition_key: String,
    /// Message headers (traceparent, type, ...).
    pub headers: Headers,
    /// The message body.
    pub payload: Bytes,
}

impl OutboxRecord {
    /// The broker message for this record.
    pub fn to_message(&self) -> Message {
        Message {
            id: self.event_id.clone(),
            topic: self.topic.clone(),
            key: self.partition_key.clone(),
            headers: self.headers.clone(),
            payload: self.payload.clone(),
        }
    }
}

/// An unpublished outbox row claimed by a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingOutbox {
    /// The row id; the relay publishes in id order.
    pub id: i64,
    /// The event.
    pub record: OutboxRecord,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// Failed publish attempts so far (0 the first time it is claimed).
    pub attempts: u32,
}

/// A row the broker accepted, as long as the outbox keeps it
/// ([`OutboxStore::outbox_prune`] deletes it after its retention).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedOutbox {
    /// The row id (commit order is not id order; see
    /// [`OutboxStore::outbox_claim`]).
    pub id: i64,
    /// The event id.
    pub event_id: String,
    /// When it was marked published.
    pub published_at: DateTime<Utc>,
}

/// The relay's view of the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OutboxStats {
    /// Rows waiting to be published (parked rows not included; the rows
    /// held back behind a parked row are).
    pub unpublished: u64,
    /// Age of the oldest of those rows: the relay lag.
    pub oldest_unpublished_age: Option<Duration>,
    /// Rows parked because the broker refused them for good.
    #[serde(default)]
    pub parked: u64,
}

/// An outbox row the broker refused for good (`BrokerError::Invalid`),
/// parked by the relay: it is not published, and neither is any later row
/// of its partition key, until an operator replays it
/// ([`OutboxAdminStore::outbox_unpark`]) or discards it
/// ([`OutboxAdminStore::outbox_discard`]). Rows of other keys flow on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedOutbox {
    /// The row id.
    pub id: i64,
    /// The event.
    pub record: OutboxRecord,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// When the relay parked it.
    pub parked_at: DateTime<Utc>,
    /// Failed publish attempts, the refusal included.
    pub attempts: u32,
    /// Why the broker refused it.
    pub last_error: String,
    /// Unpublished rows of the same key waiting behind it.
    pub held_back: u64,
}

/// Which parked outbox rows to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParkedFilter {
    /// Only this topic.
    pub topic: Option<String>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

fn parking_unsupported(what: &str) -> StoreError {
    StoreError::Other(format!("this store does not support {what} (parked outbox rows)").into())
}

/// The transactional outbox table, as the application (appending in its
/// transaction) and the relay (claiming, publishing, parking, pruning,
/// reporting its lag) use it.
#[async_trait]
pub trait OutboxStore: Store {
    /// Adds events inside the caller's business transaction.
    /// [`StoreError::Conflict`] if an event id is already in the outbox.
    async fn outbox_append(
        &self,
        tx: &mut Self::Tx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError>;
    /// Claims up to `limit` unpublished rows, lowest id first, for `lease`:
    /// other relays skip them until the lease ends. A row whose partition key
    /// has an earlier unpublished row claimed by another relay is not
    /// returned, so per-key order survives several relays. A parked row is
    /// never returned, nor is any later row of its key (see
    /// [`outbox_park`](Self::outbox_park)). Never skips a
    /// row because a higher id committed first. Rows already leased by
    /// `relay` itself are returned again (lease renewed), so a restarted
    /// relay with the same name resumes at once.
    async fn outbox_claim(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError>;
    /// Marks rows published (after the broker accepted them).
    async fn outbox_mark_published(&self, ids: &[i64]) -> Result<(), StoreError>;
    /// Gives rows `relay` claimed back without publishing them. A row whose
    /// claim is no longer `relay`'s (its lease ran out and another relay
    /// claimed it) is left alone: a relay slower than its lease must not
    /// free its successor's claim.
    async fn outbox_release(&self, relay: &str, ids: &[i64]) -> Result<(), StoreError>;
    /// Deletes up to `batch` rows published before `before`; returns how many.
    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
    /// Moves up to `batch` rows published before `before` to the archive
    /// (one transaction: a row is in the outbox or the archive, never in
    /// neither); returns how many left the outbox. The default refuses: a
    /// store without an archive table must not lose rows it was asked to
    /// keep.
    async fn outbox_archive(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        let _ = (before, batch);
        Err(StoreError::other("this store cannot archive outbox rows"))
    }
    /// Unpublished count and relay lag, and the parked count.
    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError>;
    /// Gives rows `relay` claimed back after a failed publish that may
    /// succeed later (the broker was unreachable, the outcome is unknown):
    /// each row's attempt count goes up by one and `error` is kept as its
    /// last error. Rows no longer claimed by `relay` are left alone, as in
    /// [`outbox_release`](Self::outbox_release). The default releases them
    /// without counting.
    async fn outbox_release_failed(
        &self,
        relay: &str,
        ids: &[i64],
        error: &str,
    ) -> Result<(), StoreError> {
        let _ = error;
        self.outbox_release(relay, ids).await
    }
    /// Parks an unpublished row the broker refused for good: it is
    /// released, its attempt count goes up by one, `error` is kept, and it
    /// is never claimed again, nor is any later row of its partition key,
    /// until it is unparked or discarded. `false` if there is no such
    /// unpublished, unparked row.
    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let _ = (id, error);
        Err(parking_unsupported("parking"))
    }
}

/// The outbox table as an operator reads and repairs it: the publication
/// record and the archive, and parked rows to list, replay or discard.
/// Apart from [`OutboxStore`] so neither the application nor the relay
/// needs it, and a backend can offer them before it.
#[async_trait]
pub trait OutboxAdminStore: Store {
    /// Up to `limit` archived rows with ids above `after`, lowest id
    /// first (page on with the last id seen).
    async fn outbox_archived(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<PublishedOutbox>, StoreError> {
        let _ = (after, limit);
        Ok(Vec::new())
    }
    /// Up to `limit` published rows with ids above `after`, lowest id
    /// first: the publication record, for an audit that checks every
    /// committed event left (page on with the last id seen).
    async fn outbox_published(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<PublishedOutbox>, StoreError>;
    /// Parked rows, lowest id first.
    async fn outbox_parked(&self, filter: &ParkedFilter) -> Result<Vec<ParkedOutbox>, StoreError> {
        let _ = filter;
        Err(parking_unsupported("listing"))
    }
    /// One parked row.
    async fn outbox_parked_get(&self, id: i64) -> Result<Option<ParkedOutbox>, StoreError> {
        let _ = id;
        Err(parking_unsupported("reading"))
    }
    /// Replays a parked row: it is claimable again with no attempts and no
    /// error, and, keeping its id, it is still published before the later
    /// rows of its key. `false` if the row is not parked.
    async fn outbox_unpark(&self, id: i64) -> Result<bool, StoreError> {
        let _ = id;
        Err(parking_unsupported("replaying"))
    }
    /// Deletes a parked row for good, which frees the later rows of its
    /// key. `false` if the row is not parked.
    async fn outbox_discard(&self, id: i64) -> Result<bool, StoreError> {
        let _ = id;
        Err(parking_unsupported("discarding"))
    }
}
