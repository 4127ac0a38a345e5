//! A dedupe record shared by every consumer process, for effects that
//! cannot join a transaction: the inbox's weaker sibling.
//!
//! The inbox (`InboxStore`) commits the dedupe row with the effect, so a
//! message's effect happens exactly once. An effect outside the store (a
//! push notification, a cache write, a call to an API without idempotency
//! keys) cannot commit with anything. For those, a [`SharedDedupStore`]
//! keeps, per message, a *claim* while one consumer works on it and a
//! *done* mark for a while after:
//!
//! 1. [`dedup_claim`](SharedDedupStore::dedup_claim) before the effect:
//!    [`DedupClaim::Claimed`] means do it, [`DedupClaim::Done`] means it was
//!    done (ack and skip), [`DedupClaim::InProgress`] means another consumer
//!    is on it now (leave it for redelivery);
//! 2. [`dedup_complete`](SharedDedupStore::dedup_complete) after the effect
//!    succeeded, or [`dedup_abandon`](SharedDedupStore::dedup_abandon) after
//!    it failed, so the redelivery tries again.
//!
//! **The promise is at least once, with duplicates made rare, never lost.**
//! A consumer that dies after the effect and before `dedup_complete` leaves
//! a claim that runs out after its lease: the redelivery does the effect
//! again. A done mark is forgotten after its time (and, on a store without
//! persistence, at a restart): a duplicate arriving later gets through. So
//! the effect must still tolerate a rare duplicate. Where it cannot, use the
//! inbox, in the effect's transaction.

use std::time::Duration;

use async_trait::async_trait;

use crate::StoreError;

/// Who holds a claim: given by [`SharedDedupStore::dedup_claim`], needed to
/// complete or abandon it, so a consumer whose claim ran out and was taken
/// by another cannot complete the other's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DedupToken(pub String);

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DedupClaim {
    /// Nobody has done it and nobody is on it: do the effect, then complete
    /// or abandon with this token.
    Claimed(DedupToken),
    /// Done within the remembered time: skip the effect, ack the message.
    Done,
    /// Another consumer holds a live claim: leave the message for
    /// redelivery (a nack with a delay), do not ack it.
    InProgress,
}

/// The shared dedupe record: a claim while one consumer works on a
/// message, a done mark for a while after. At least once, duplicates rare,
/// never lost: a consumer that dies between its effect and
/// [`dedup_complete`](Self::dedup_complete) leaves a claim that runs out,
/// and the redelivery does the effect again.
#[async_trait]
pub trait SharedDedupStore: Clone + Send + Sync + 'static {
    /// Claims message `id` of `scope` (a consumer group, a handler) for
    /// `lease`, unless it is done or claimed by someone else.
    async fn dedup_claim(
        &self,
        scope: &str,
        id: &str,
        lease: Duration,
    ) -> Result<DedupClaim, StoreError>;

    /// Marks the message done for `remember`, if `token` still holds its
    /// claim; `false` when the claim had run out and someone else took it
    /// (the effect may then happen twice, which the promise allows).
    async fn dedup_complete(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
        remember: Duration,
    ) -> Result<bool, StoreError>;

    /// Gives the claim back, if `token` still holds it, so the next
    /// delivery does the effect at once instead of a lease later.
    async fn dedup_abandon(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
    ) -> Result<bool, StoreError>;
}
