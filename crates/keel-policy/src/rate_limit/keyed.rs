//! One rate limit per key (tenant, API key, client address), in bounded
//! memory.

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use governor::Quota;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use keel_core::{Name, PolicyError, Rejected};

use super::store::KeyTable;
use super::{Refusals, TokioClock, wait_time, wait_until_conforming};

type KeyedGcra<K> = governor::RateLimiter<K, KeyTable<K>, TokioClock, NoOpMiddleware<Nanos>>;

/// A rate limit per key; every key gets the same quota.
///
/// # Bounded memory
///
/// Keys come from requests, so an attacker could send endless distinct
/// ones. Two bounds keep memory in check:
///
/// - Idle keys are evicted: after every `max_keys / 8` keys not seen
///   before, governor's `retain_recent` drops every key whose limit has
///   fully refilled (and stayed so for one emission interval): such a key
///   is indistinguishable from a new one, so evicting it never grants
///   extra calls. Call
///   [`evict_idle`](Self::evict_idle) on a schedule to do it between
///   bursts too.
/// - At most `max_keys` keys are tracked. When the table is full, calls for
///   keys not in it share one *overflow* limit with the same quota: they
///   are still limited (together, so a flood of fresh keys is throttled as
///   one client), and the tracked keys keep their own limits.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
/// use std::time::Duration;
/// use keel_policy::rate_limit::{KeyedRateLimiter, RateLimiter};
///
/// let per_client: KeyedRateLimiter<u64> =
///     RateLimiter::builder("api").rate(1, Duration::from_secs(1)).build_keyed().unwrap();
/// assert!(per_client.check_key(&7).is_ok());
/// assert!(per_client.check_key(&7).is_err());
/// assert!(per_client.check_key(&8).is_ok(), "each key has its own limit");
/// # });
/// ```
pub struct KeyedRateLimiter<K: Hash + Eq + Clone> {
    shared: Arc<KeyedShared<K>>,
}

struct KeyedShared<K: Hash + Eq + Clone> {
    gcra: KeyedGcra<K>,
    refusals: Refusals,
    new_keys: Arc<AtomicUsize>,
    evict_every: usize,
    max_keys: usize,
}

impl<K: Hash + Eq + Clone> KeyedRateLimiter<K> {
    pub(super) fn new(name: Name, quota: Quota, max_keys: usize) -> Self {
        let new_keys = Arc::new(AtomicUsize::new(0));
        let overflow_total =
            metrics::counter!("keel_rate_limit_overflow_total", "name" => name.as_str());
        let table = KeyTable::new(max_keys, Arc::clone(&new_keys), overflow_total);
        let shared = KeyedShared {
            gcra: governor::RateLimiter::new(quota, table, TokioClock::new()),
            refusals: Refusals::new(name),
            new_keys,
            evict_every: (max_keys / 8).max(1),
            max_keys,
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Takes one call's worth of `key`'s limit now, or refuses with
    /// [`Rejected::RateLimited`] saying when a call would conform.
    #[inline]
    pub fn check_key(&self, key: &K) -> Result<(), Rejected> {
        let gcra = &self.shared.gcra;
        let decision = gcra.check_key(key);
        self.evict_if_due();
        decision.map_err(|not_until| {
            self.shared
                .refusals
                .refuse(wait_time(gcra.clock(), &not_until))
        })
    }

    /// Waits until a call for `key` conforms and takes it, but never past
    /// the current [`Deadline`](keel_core::Deadline).
    pub async fn acquire_key(&self, key: &K) -> Result<(), Rejected> {
        let gcra = &self.shared.gcra;
        let check = || {
            let decision = gcra.check_key(key);
            self.evict_if_due();
            decision
        };
        wait_until_conforming(check, gcra.clock(), &self.shared.refusals).await
    }

    /// Runs `f` if `key`'s limit allows a call now; refuses at once
    /// otherwise.
    pub async fn call<T, E, F, Fut>(&self, key: &K, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.check_key(key)?;
        f().await.map_err(PolicyError::Inner)
    }

    /// Runs `f` once `key`'s limit allows, waiting as
    /// [`acquire_key`](Self::acquire_key) does.
    pub async fn call_waiting<T, E, F, Fut>(&self, key: &K, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.acquire_key(key).await?;
        f().await.map_err(PolicyError::Inner)
    }

    /// How many keys are tracked now (at most `max_keys`, give or take the
    /// keys being inserted at this very moment by other threads).
    pub fn len(&self) -> usize {
        self.shared.gcra.len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.shared.gcra.is_empty()
    }

    /// Forgets every key whose limit has fully refilled, and gives the
    /// memory back. Run it on a schedule to shrink between bursts of keys.
    pub fn evict_idle(&self) {
        self.shared.new_keys.store(0, Relaxed);
        self.shared.gcra.retain_recent();
        self.shared.gcra.shrink_to_fit();
    }

    /// The limiter's name.
    pub fn name(&self) -> &Name {
        &self.shared.refusals.name
    }

    #[inline]
    fn evict_if_due(&self) {
        let every = self.shared.evict_every;
        // The load keeps the common case to a read; the swap lets one
        // caller, not all of them, do the eviction.
        if self.shared.new_keys.load(Relaxed) >= every
            && self.shared.new_keys.swap(0, Relaxed) >= every
        {
            self.shared.gcra.retain_recent();
        }
    }
}

impl<K: Hash + Eq + Clone> Clone for KeyedRateLimiter<K> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K: Hash + Eq + Clone> fmt::Debug for KeyedRateLimiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedRateLimiter")
            .field("name", &self.shared.refusals.name)
            .field("max_keys", &self.shared.max_keys)
            .finish_non_exhaustive()
    }
}
