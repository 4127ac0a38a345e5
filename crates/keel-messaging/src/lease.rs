//! Leases on the database, and leader election built on them.
//!
//! "SETNX is a lease, not a lock." A lock that expires (Redis `SET NX PX`,
//! a row with a timeout) cannot promise mutual exclusion: its holder can
//! pause past the expiry (a GC pause, a stalled VM), another process takes
//! it over, and the first wakes up still believing it holds it. So this
//! module hands out a [`Lease`], never a lock: it has an end, which the
//! holder must watch ([`Lease::is_live`]), and a [`FencingToken`] that is
//! higher for every new holder, which every write to the shared resource
//! must carry and the resource must check ([`crate::fence`]). Mutual
//! exclusion is then best effort, and safety comes from the token.
//!
//! - [`LeaseLock::try_acquire`] takes the lease if it is free or expired,
//!   or extends it for its current holder (same token);
//! - [`LeaseLock::release`] ends it early (the next holder's token is still
//!   higher);
//! - [`LeaderElection`] campaigns for a lease, runs the leader's work while
//!   it holds it, renews it at a third of its length, and stops the work
//!   as soon as a renewal fails or the lease's time runs out locally,
//!   whichever comes first; then it campaigns again.
//!
//! On SQLite the lease serves the processes sharing one database file
//! (usually one); on PostgreSQL it elects one leader among any number of
//! processes.
//!
//! ```
//! use std::time::Duration;
//! use keel_messaging::lease::LeaseLock;
//! # async fn demo<S: keel_messaging::store::LeaseStore>(store: S) -> Result<(), keel_messaging::StoreError> {
//! let lock = LeaseLock::new(store, "nightly-report", "pod-a", Duration::from_secs(30));
//! if let Some(lease) = lock.try_acquire().await? {
//!     // Every write to the shared resource carries lease.token(), checked there.
//!     let _token = lease.token();
//!     lock.release(&lease).await?;
//! }
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use keel_core::clock::{self, Instant};

use crate::fence::FencingToken;
use crate::store::{Election, Leadership, LeaseStore, StoreError};

/// A lease held: its token and when it ends by this process's clock
/// (measured from before the request, so never later than the store's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    name: String,
    token: FencingToken,
    ends: Instant,
}

impl Lease {
    /// The fencing token every write under this lease must carry.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the lease still runs by this process's clock. A `true` is
    /// no promise that nobody else holds it (a pause can come right after
    /// the check): the token is what makes writes safe.
    pub fn is_live(&self) -> bool {
        clock::now() < self.ends
    }

    /// Time left by this process's clock.
    pub fn remaining(&self) -> Duration {
        self.ends.saturating_duration_since(clock::now())
    }
}

/// Takes, extends and releases one named lease for one holder. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct LeaseLock<S> {
    store: S,
    name: String,
    holder: String,
    ttl: Duration,
}

impl<S: LeaseStore> LeaseLock<S> {
    /// The lease `name` held as `holder` (unique per process: a pod name,
    /// a random id) for `ttl` at a time.
    pub fn new(
        store: S,
        name: impl Into<String>,
        holder: impl Into<String>,
        ttl: Duration,
    ) -> Self {
        Self {
            store,
            name: name.into(),
            holder: holder.into(),
            ttl,
        }
    }

    /// The lease's length.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Takes the lease if it is free or expired, or extends it if this
    /// holder has it; `None` while another holder's lease runs.
    pub async fn try_acquire(&self) -> Result<Option<Lease>, StoreError> {
        let asked = clock::now();
        let grant = self
            .store
            .lease_acquire(&self.name, &self.holder, self.ttl)
            .await?;
        Ok(grant.map(|grant| Lease {
            name: self.name.clone(),
            token: FencingToken::new(grant.token),
            ends: asked + self.ttl,
        }))
    }

    /// Extends `lease`; `None` if it was lost meanwhile (expired and taken,
    /// or taken again under a new token).
    pub async fn renew(&self, lease: &Lease) -> Result<Option<Lease>, StoreError> {
        Ok(self
            .try_acquire()
            .await?
            .filter(|renewed| renewed.token == lease.token))
    }

    /// Ends `lease` now, if it is still this holder's.
    pub async fn release(&self, lease: &Lease) -> Result<bool, StoreError> {
        self.store
            .lease_release(&self.name, &self.holder, lease.token.into())
            .await
    }
}

/// Runs work on one process at a time: the holder of a lease. See the
/// [module docs](self).
#[derive(Debug, Clone)]
pub struct LeaderElection<S> {
    lock: LeaseLock<S>,
}

impl<S: LeaseStore> LeaderElection<S> {
    /// An election for `lock`'s lease.
    pub fn new(lock: LeaseLock<S>) -> Self {
        Self { lock }
    }

    /// Until `shutdown` completes: campaigns for the lease every third of
    /// its length, and while this process holds it runs `lead(lease)`. The
    /// work is dropped (cancelled) the moment leadership is lost; when it
    /// returns by itself, the lease is released and the campaign goes on.
    pub async fn run<F, Fut>(&self, mut lead: F, shutdown: impl Future<Output = ()>)
    where
        F: FnMut(Lease) -> Fut,
        Fut: Future<Output = ()>,
    {
        let period = self.lock.ttl / 3;
        tokio::pin!(shutdown);
        loop {
            let lease = match self.lock.try_acquire().await {
                Ok(lease) => lease,
                Err(error) => {
                    tracing::warn!(lease = %self.lock.name, %error, "leader election: could not campaign");
                    None
                }
            };
            if let Some(lease) = lease {
                metrics::counter!("keel_leader_elected_total", "lease" => self.lock.name.clone())
                    .increment(1);
                tracing::info!(lease = %self.lock.name, token = %lease.token(), "elected leader");
                let work = lead(lease.clone());
                tokio::select! {
                    () = &mut shutdown => {
                        let _ = self.lock.release(&lease).await;
                        return;
                    }
                    () = work => {
                        let _ = self.lock.release(&lease).await;
                    }
                    () = self.hold(lease.clone()) => {
                        metrics::counter!("keel_leader_lost_total", "lease" => self.lock.name.clone())
                            .increment(1);
                        tracing::warn!(lease = %self.lock.name, "leadership lost: the leader's work was stopped");
                    }
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(period) => {}
            }
        }
    }

    /// Renews `lease` every third of its length; returns when it is lost:
    /// a renewal refused, or failing until the lease's time ran out.
    async fn hold(&self, mut lease: Lease) {
        let period = self.lock.ttl / 3;
        loop {
            tokio::time::sleep(period.min(lease.remaining())).await;
            if !lease.is_live() {
                return;
            }
            match self.lock.renew(&lease).await {
                Ok(Some(renewed)) => lease = renewed,
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(lease = %self.lock.name, %error, "could not renew the lease; retrying while it lasts");
                }
            }
        }
    }
}

type Holds = dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync;

/// "Does this process hold the lease now?", for a job that must run on one
/// process at a time (the outbox relay's prune,
/// [`prune_under`](crate::outbox::RelayBuilder::prune_under)): each
/// question takes or extends the lease. A store error answers no.
#[derive(Clone)]
pub struct LeaseGate {
    holds: std::sync::Arc<Holds>,
}

impl std::fmt::Debug for LeaseGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseGate")
    }
}

impl LeaseGate {
    /// A gate on `lock`'s lease.
    pub fn new<S: LeaseStore>(lock: LeaseLock<S>) -> Self {
        Self {
            holds: std::sync::Arc::new(move || {
                let lock = lock.clone();
                Box::pin(async move {
                    match lock.try_acquire().await {
                        Ok(lease) => lease.is_some(),
                        Err(error) => {
                            tracing::warn!(lease = %lock.name, %error, "could not take the lease");
                            false
                        }
                    }
                })
            }),
        }
    }

    /// A gate open while this process leads `election` as `holder`: a
    /// task campaigns, keeps the leadership until it is lost, then
    /// campaigns again (after a failed campaign, 1 s to 30 s later, with
    /// jitter). Each question is answered at once from the current
    /// leadership, which ends by this process's own clock before the
    /// election could pick another leader. The task stops when the last
    /// clone of the gate is dropped. Call it inside a Tokio runtime.
    ///
    /// ```
    /// # async fn demo<S: keel_store::LeaseStore>(store: S) {
    /// use std::time::Duration;
    /// use keel_messaging::election::LeaseElection;
    /// use keel_messaging::lease::LeaseGate;
    ///
    /// let election = LeaseElection::new(store, "retention", Duration::from_secs(30));
    /// let gate = LeaseGate::leading(election, "pod-a");
    /// if gate.holds().await {
    ///     // This process leads: prune.
    /// }
    /// # }
    /// ```
    pub fn leading<E: Election>(election: E, holder: impl Into<String>) -> Self {
        let current: std::sync::Arc<parking_lot::Mutex<Option<std::sync::Arc<dyn Leadership>>>> =
            std::sync::Arc::default();
        let task = tokio::spawn(campaign_forever(
            election,
            holder.into(),
            std::sync::Arc::clone(&current),
        ));
        let task = std::sync::Arc::new(AbortOnDrop(task.abort_handle()));
        Self {
            holds: std::sync::Arc::new(move || {
                let _task = &task;
                let leading = current
                    .lock()
                    .as_ref()
                    .is_some_and(|leadership| leadership.is_leader());
                Box::pin(std::future::ready(leading))
            }),
        }
    }

    /// Takes or extends the lease; whether this process holds it.
    pub async fn holds(&self) -> bool {
        (self.holds)().await
    }
}

/// Aborts the task when the last gate goes.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The longest a failed campaign waits before the next.
const MAX_CAMPAIGN_BACKOFF: Duration = Duration::from_secs(30);

/// Campaigns, leads until the leadership is lost, and campaigns again.
async fn campaign_forever<E: Election>(
    election: E,
    holder: String,
    current: std::sync::Arc<parking_lot::Mutex<Option<std::sync::Arc<dyn Leadership>>>>,
) {
    // 1 s, 2 s, 4 s... up to 30 s, each between half and all of it.
    let backoff =
        keel_policy::retry::Backoff::exponential(Duration::from_secs(1), 2.0, MAX_CAMPAIGN_BACKOFF)
            .and_then(|b| b.with_jitter(keel_policy::retry::Jitter::Equal))
            .expect("a valid backoff");
    let mut failures = 0;
    loop {
        match election.campaign(&holder).await {
            Ok(leadership) => {
                failures = 0;
                let leadership: std::sync::Arc<dyn Leadership> = leadership.into();
                tracing::info!(%holder, token = leadership.token(), "elected");
                *current.lock() = Some(std::sync::Arc::clone(&leadership));
                leadership.lost().await;
                current.lock().take();
                tracing::warn!(%holder, "leadership lost; campaigning again");
            }
            Err(error) => {
                let wait = backoff.delay(failures).unwrap_or(MAX_CAMPAIGN_BACKOFF);
                failures = failures.saturating_add(1);
                tracing::warn!(%holder, %error, ?wait, "campaign failed; trying again");
                tokio::time::sleep(wait).await;
            }
        }
    }
}
