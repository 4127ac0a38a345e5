//! Holding an in-flight key: its lock is renewed while the handler runs.
//!
//! The lock is what frees a key whose process died: nobody completes or
//! releases it, so after the lock a retry takes it over. A long lock keeps
//! such a client waiting (`409`) for minutes; a short one could pass under
//! a request that is merely slow, and let a retry run the handler a second
//! time at once. Renewing resolves both: the lock is short (10 s by
//! default), and a live holder extends it every third of it, so only a
//! holder that stopped renewing, a dead one, loses its key.
//!
//! Renewal is a store write, so it can fail. A holder that cannot renew
//! before its lock passes stops its handler (the handler's future is
//! dropped) a margin before it does: after the lock a retry may take the
//! key over, and two runs of one request at the same time are what the
//! layer exists to prevent. The margin, a fifth of the lock, covers the
//! write in flight and clock skew between processes (the lock is stored as
//! wall-clock time).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_store::IdempotencyStore;
use keel_store::StoreError;

use super::held::Held;
use super::service::{after, wall_now};

/// How soon a failed renewal is tried again.
const RENEW_RETRY: Duration = Duration::from_millis(250);

/// An in-flight key this request owns, and when its lock was last written.
pub(crate) struct Lease<S> {
    pub(crate) store: S,
    /// The key, its principal and this attempt's owner token (the store
    /// lets only that token renew or settle the key), shared with the
    /// handler's [`HeldKey`](super::HeldKey).
    pub(crate) held: Arc<Held>,
    lock: Duration,
    /// When the last lock the store confirmed was asked for: the lock is
    /// this holder's until `renewed + lock` at least.
    renewed: Instant,
}

/// Why a holder stopped before its handler finished.
#[derive(Debug)]
pub(crate) enum LockLost {
    /// The key is no longer this request's (taken over, or pruned).
    TakenOver,
    /// The store did not confirm a renewal before the lock would pass.
    Unconfirmed(StoreError),
}

impl<S: IdempotencyStore> Lease<S> {
    /// A key begun at `asked` (before the store was asked), locked for `lock`.
    pub(crate) fn new(store: S, held: Arc<Held>, lock: Duration, asked: Instant) -> Self {
        Self {
            store,
            held,
            lock,
            renewed: asked,
        }
    }

    /// Runs `work` while renewing the lock. If the lock cannot be kept,
    /// `work` is dropped and the reason returned.
    pub(crate) async fn hold<F: Future>(&mut self, work: F) -> Result<F::Output, LockLost> {
        tokio::select! {
            biased;
            output = work => Ok(output),
            lost = self.keep() => {
                metrics::counter!("keel_idempotency_lock_lost_total").increment(1);
                if matches!(lost, LockLost::TakenOver) {
                    tracing::warn!(principal = %self.held.principal, key = %self.held.key,
                        "idempotency key taken over by another request; this one is stopped");
                }
                Err(lost)
            }
        }
    }

    /// Renews the lock every third of it until it cannot; never returns
    /// while the lock is kept.
    async fn keep(&mut self) -> LockLost {
        let mut next = self.renewed + self.lock / 3;
        loop {
            tokio::time::sleep_until(next).await;
            let give_up_at = self.renewed + self.lock - self.lock / 5;
            let asked = clock::now();
            let held = &self.held;
            let renew = self.store.idempotency_renew(
                &held.principal,
                &held.key,
                &held.owner,
                after(wall_now(), self.lock),
            );
            match tokio::time::timeout_at(give_up_at, renew).await {
                Ok(Ok(true)) => {
                    self.renewed = asked;
                    next = asked + self.lock / 3;
                }
                // The handler's transaction completed the key: nothing
                // is left to hold.
                Ok(Ok(false)) if self.held.written() => std::future::pending().await,
                Ok(Ok(false)) => return LockLost::TakenOver,
                Ok(Err(err)) if clock::now() + RENEW_RETRY >= give_up_at => {
                    return LockLost::Unconfirmed(err);
                }
                Ok(Err(err)) => {
                    tracing::debug!(error = %err, key = %held.key, "renewing an idempotency key's lock failed");
                    next = clock::now() + RENEW_RETRY;
                }
                Err(_) => {
                    return LockLost::Unconfirmed(StoreError::Unavailable(
                        "the store did not confirm the lock's renewal in time".into(),
                    ));
                }
            }
        }
    }
}
