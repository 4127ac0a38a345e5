//! Settling a key after its handler ran: storing the response or releasing
//! the key, retried in the background while the store is down.
//!
//! The handler's effect has happened by then, so giving up on the first
//! store error would leave the key in flight until its lock passes and a
//! retry takes it over, running the handler a second time, although the
//! store may be back a moment later. So a settle that failed with an error
//! worth retrying (the store unavailable, or a commit whose outcome is
//! unknown) is tried again with jittered backoff, for up to
//! [`SETTLE_RETRY_FOR`]. A late write is safe: the store accepts it only
//! from the key's owner, so once a retry took the key over, this settle
//! changes nothing and stops.
//!
//! The handler's answer goes out fresh only if the first try was
//! confirmed. An unconfirmed key is not renewed, so its lock can pass and a
//! retry take it over and run the handler again: had the first answer gone
//! out too, one key would have two fresh answers. The client gets `503`
//! instead, and its retry the response that was kept, whichever request
//! kept it.

use std::time::Duration;

use keel_core::clock;
use keel_policy::retry::{Backoff, Jitter};
use keel_store::StoreError;
use keel_store::{IdempotencyStore, StoredResponse};

use super::lease::Lease;

/// The first wait before trying a failed settle again.
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// The longest wait between two tries.
const MAX_RETRY: Duration = Duration::from_secs(5);

/// How long a failed settle is tried again: 5 minutes. A bound, so that a
/// store down for good does not keep a task per request alive forever.
pub(crate) const SETTLE_RETRY_FOR: Duration = Duration::from_secs(5 * 60);

/// What to do with an in-flight key.
#[derive(Debug, Clone)]
pub(crate) enum Settle {
    /// Store the response; the key replays it from now on.
    Complete(StoredResponse),
    /// Forget the key, so a retry runs again.
    Release(&'static str),
}

impl Settle {
    fn name(&self) -> &'static str {
        match self {
            Self::Complete(_) => "storing the idempotent response",
            Self::Release(_) => "releasing the idempotency key",
        }
    }
}

/// Whether the store confirmed a settle on its first try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The key is this request's no more: completed with its response, or
    /// released.
    Confirmed,
    /// The store failed (a background task may keep trying), or the key is
    /// another request's now.
    Unconfirmed,
}

impl<S: IdempotencyStore> Lease<S> {
    /// Settles the key once; if the store failed in a way worth retrying,
    /// keeps trying in a background task (see the module docs).
    pub(crate) async fn settle(self, settle: Settle) -> Settled {
        if let Settle::Release(why) = &settle {
            metrics::counter!("keel_idempotency_released_total", "reason" => *why).increment(1);
            tracing::debug!(principal = %self.held.principal, key = %self.held.key, reason = why,
                "idempotency key released");
        }
        match self.write(&settle).await {
            Ok(()) => return Settled::Confirmed,
            Err(StoreError::NotFound(_)) => {
                metrics::counter!("keel_idempotency_lock_lost_total").increment(1);
                tracing::warn!(principal = %self.held.principal, key = %self.held.key,
                    "{} found the key taken over by another request", settle.name());
            }
            Err(err) if worth_retrying(&err) => self.retry_in_background(settle, err),
            Err(err) => self.give_up(&settle, &err),
        }
        Settled::Unconfirmed
    }

    /// One later try: a complete whose key is not found is done, because an
    /// earlier try whose outcome was unknown did commit, or a retry took the
    /// key over; either way there is nothing left to do.
    async fn try_once(&self, settle: &Settle) -> Result<(), StoreError> {
        match self.write(settle).await {
            Err(StoreError::NotFound(_)) if matches!(settle, Settle::Complete(_)) => Ok(()),
            other => other,
        }
    }

    async fn write(&self, settle: &Settle) -> Result<(), StoreError> {
        match settle {
            Settle::Complete(response) => {
                self.store
                    .idempotency_complete(
                        &self.held.principal,
                        &self.held.key,
                        &self.held.owner,
                        response,
                    )
                    .await
            }
            Settle::Release(_) => {
                self.store
                    .idempotency_release(&self.held.principal, &self.held.key, &self.held.owner)
                    .await
            }
        }
    }

    fn retry_in_background(self, settle: Settle, first: StoreError) {
        metrics::counter!("keel_idempotency_store_errors_total").increment(1);
        tracing::warn!(error = %first, principal = %self.held.principal, key = %self.held.key,
            "{} failed; trying again", settle.name());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self.give_up(&settle, &first);
        };
        runtime.spawn(async move { self.retry(settle).await });
    }

    async fn retry(self, settle: Settle) {
        let give_up_at = clock::now() + SETTLE_RETRY_FOR;
        // Equal jitter: settles that failed together spread out, and none
        // comes straight back to a store that just refused it.
        let backoff = Backoff::exponential(FIRST_RETRY, 2.0, MAX_RETRY)
            .and_then(|backoff| backoff.with_jitter(Jitter::Equal))
            .expect("constant, valid bounds");
        for jittered in backoff.iter() {
            if clock::now() + jittered >= give_up_at {
                let err = StoreError::Unavailable("the store stayed down".into());
                return self.give_up(&settle, &err);
            }
            tokio::time::sleep(jittered).await;
            match self.try_once(&settle).await {
                Ok(()) => {
                    metrics::counter!("keel_idempotency_settle_retried_total").increment(1);
                    tracing::info!(principal = %self.held.principal, key = %self.held.key,
                        "{} succeeded on a later try", settle.name());
                    return;
                }
                Err(err) if worth_retrying(&err) => {
                    metrics::counter!("keel_idempotency_store_errors_total").increment(1);
                }
                Err(err) => return self.give_up(&settle, &err),
            }
        }
    }

    fn give_up(&self, settle: &Settle, err: &StoreError) {
        metrics::counter!("keel_idempotency_store_errors_total").increment(1);
        tracing::error!(error = %err, principal = %self.held.principal, key = %self.held.key,
            "{} failed; a retry takes the key over once its lock passes", settle.name());
    }
}

fn worth_retrying(err: &StoreError) -> bool {
    matches!(
        err,
        StoreError::Unavailable(_) | StoreError::OutcomeUnknown(_)
    )
}
