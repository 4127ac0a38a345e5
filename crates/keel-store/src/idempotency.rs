//! Idempotency keys with their stored responses: one contract that
//! records a key before the request runs, leases it to one attempt, and
//! replays what it answered.

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};

/// A response stored under an idempotency key, replayed for retries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The HTTP status.
    pub status: u16,
    /// Headers worth replaying (content type, location, ...).
    pub headers: Vec<(String, String)>,
    /// The body bytes.
    pub body: Bytes,
}

/// What an idempotency key already stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyBegin {
    /// The key is new (or was taken over) and is now in flight under the
    /// claim's owner: process the request.
    Started,
    /// A request with this key is being processed right now.
    InFlight,
    /// The key finished before with this response: replay it.
    Completed(StoredResponse),
    /// The key was used before for a different request (fingerprint).
    Mismatch,
}

/// A request's claim on an idempotency key: who asks, for which request,
/// under which owner token, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyClaim<'a> {
    /// Whose keys these are (keys are scoped per principal).
    pub principal: &'a str,
    /// The key.
    pub key: &'a str,
    /// The request's fingerprint: the same key with another is a mismatch.
    pub fingerprint: &'a str,
    /// A token unique to this attempt. Only its holder may renew, complete
    /// or release the key, so a holder that lost its lock to a takeover can
    /// never overwrite its successor.
    pub owner: &'a str,
    /// Until when the in-flight key is locked to `owner`. The holder renews
    /// it while it works ([`IdempotencyStore::idempotency_renew`]); once it
    /// has passed the holder is presumed dead and a request with the same
    /// fingerprint takes the key over.
    pub locked_until: DateTime<Utc>,
    /// When the key expires (inclusive); after that any request starts it
    /// afresh. A lock never outlives it.
    pub expires_at: DateTime<Utc>,
}

/// Idempotency keys with their stored responses.
///
/// An in-flight key is a lease: it belongs to the claim's `owner` until
/// `locked_until`, which the owner renews while its request runs. A process
/// that dies stops renewing, so a retry takes the key over within one lock
/// period instead of waiting for the key to expire; renew, complete and
/// release all check the owner, so of two holders only the latest can
/// write.
#[async_trait]
pub trait IdempotencyStore: Store {
    /// Records the claimed key as in flight for `claim.owner`, atomically
    /// with the check, unless it exists live; says what it stands for. A
    /// key in flight past its lock, with the same fingerprint, is taken
    /// over ([`IdempotencyBegin::Started`]); with another fingerprint it is
    /// still [`IdempotencyBegin::Mismatch`]. Recording *before* processing
    /// is what makes concurrent duplicates execute once.
    async fn idempotency_begin(
        &self,
        claim: &IdempotencyClaim<'_>,
    ) -> Result<IdempotencyBegin, StoreError>;

    /// Extends the lock of a key in flight under `owner` to `locked_until`
    /// (never past the key's expiry). `Ok(false)` if the key is no longer
    /// `owner`'s: it was taken over, released, completed or pruned, and the
    /// holder must stop.
    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Stores the response for a key in flight under `owner`, making it
    /// completed. [`StoreError::NotFound`] if the key is not in flight under
    /// `owner` (taken over, released, pruned, or never begun).
    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Like [`idempotency_complete`](Self::idempotency_complete), inside the
    /// caller's transaction `tx`: the response is stored if and only if
    /// `tx` commits, atomically with the handler's own writes, and the
    /// request costs one write transaction fewer. The key's row stays
    /// locked until `tx` ends, so make it the transaction's last statement.
    async fn idempotency_complete_in(
        &self,
        tx: &mut Self::Tx,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Forgets a key in flight under `owner` whose request failed in a way
    /// the client may retry (so the retry is processed, not refused as in
    /// flight). A completed key, another owner's, or no key at all is left
    /// alone (not an error).
    async fn idempotency_release(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
    ) -> Result<(), StoreError>;

    /// Deletes up to `batch` keys that expired at or before `now`, in flight
    /// or completed; returns how many.
    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}
