//! [`LeaseElection`]: leader election on any lease store (SQLite,
//! PostgreSQL, Redis), behind the same [`Election`] contract as etcd's.
//!
//! A campaign takes the lease when it is free and keeps trying every third
//! of its length while another holds it. Once elected, the lease is renewed
//! every third of its length, and leadership lasts until the lease's end
//! *as this process measures it* (from before the request that granted or
//! renewed it): never later than the store's. A renewal refused, or none
//! answered before that end, ends the leadership for good: renewing stops,
//! so a leader that stopped working never holds the lease again.
//!
//! ```
//! # async fn demo<S: keel_store::LeaseStore>(store: S) -> Result<(), keel_store::StoreError> {
//! use std::time::Duration;
//! use keel_messaging::election::LeaseElection;
//! use keel_store::Election;
//!
//! let election = LeaseElection::new(store, "nightly-report", Duration::from_secs(10));
//! let leadership = election.campaign("pod-a").await?;
//! while leadership.is_leader() {
//!     // One step of the work, fenced by `leadership.token()`.
//! #   break;
//! }
//! leadership.resign().await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock::{self, Instant};
use tokio::task::JoinHandle;

use crate::lease::{Lease, LeaseLock};
use crate::store::{
    DeadlineRenewer, Election, Leadership, LeadershipDeadline, LeaseStore, StoreError,
    leadership_deadline,
};

/// An election on the lease `name` of a [`LeaseStore`].
#[derive(Debug, Clone)]
pub struct LeaseElection<S> {
    store: S,
    name: String,
    ttl: Duration,
}

impl<S: LeaseStore> LeaseElection<S> {
    /// The election for the lease `name`, each leadership lasting `ttl`
    /// past its last renewal.
    pub fn new(store: S, name: impl Into<String>, ttl: Duration) -> Self {
        Self {
            store,
            name: name.into(),
            ttl,
        }
    }
}

#[async_trait]
impl<S: LeaseStore> Election for LeaseElection<S> {
    async fn campaign(&self, holder: &str) -> Result<Box<dyn Leadership>, StoreError> {
        let lock = LeaseLock::new(self.store.clone(), self.name.clone(), holder, self.ttl);
        let lease = loop {
            match lock.try_acquire().await {
                Ok(Some(lease)) => break lease,
                Ok(None) => {}
                Err(error) => tracing::warn!(lease = %self.name, %error, "campaign: could not ask"),
            }
            tokio::time::sleep(self.ttl / 3).await;
        };
        tracing::info!(lease = %self.name, holder, token = %lease.token(), "elected");
        let (renewer, ends) = leadership_deadline(lease_end(&lease));
        let token = lease.token().get();
        let renewer = tokio::spawn(renew(lock.clone(), lease.clone(), renewer));
        Ok(Box::new(LeaseLeadership {
            lock,
            lease,
            token,
            ends,
            renewer,
        }))
    }
}

fn lease_end(lease: &Lease) -> Instant {
    clock::now() + lease.remaining()
}

/// Renews every third of the lease's length until a renewal is refused or
/// none is answered before the lease ends; then sets the end to now and
/// stops for good.
async fn renew<S: LeaseStore>(lock: LeaseLock<S>, mut lease: Lease, ends: DeadlineRenewer) {
    let period = lock.ttl() / 3;
    loop {
        tokio::time::sleep(period.min(lease.remaining())).await;
        if !lease.is_live() {
            break;
        }
        match lock.renew(&lease).await {
            Ok(Some(renewed)) if ends.extend(lease_end(&renewed)) => lease = renewed,
            Ok(Some(_)) => break,
            Ok(None) => break,
            Err(error) => {
                tracing::warn!(lease = %lease.name(), %error, "renewal failed; retrying while the lease lasts")
            }
        }
    }
    tracing::warn!(lease = %lease.name(), "leadership lost");
    ends.end();
}

/// A leadership on a lease; see [`Leadership`].
struct LeaseLeadership<S> {
    lock: LeaseLock<S>,
    lease: Lease,
    token: u64,
    ends: LeadershipDeadline,
    renewer: JoinHandle<()>,
}

impl<S> std::fmt::Debug for LeaseLeadership<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseLeadership")
            .field("lease", &self.lease.name())
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl<S> Drop for LeaseLeadership<S> {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

#[async_trait]
impl<S: LeaseStore> Leadership for LeaseLeadership<S> {
    fn token(&self) -> u64 {
        self.token
    }

    fn is_leader(&self) -> bool {
        self.ends.is_live()
    }

    async fn lost(&self) {
        self.ends.passed().await;
    }

    async fn resign(self: Box<Self>) -> Result<(), StoreError> {
        self.renewer.abort();
        self.lock.release(&self.lease).await.map(drop)
    }
}
