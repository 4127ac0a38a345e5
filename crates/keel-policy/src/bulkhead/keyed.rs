//! One bulkhead compartment per key (tenant, user, route), in bounded memory.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use keel_core::{Name, PolicyError, Rejected};
use parking_lot::RwLock;

use super::{BulkheadConfig, BulkheadStats, Compartment, Rules};
use crate::slots::Slot;

/// A bulkhead per key, so one tenant saturating its slots does not take
/// another's.
///
/// # Bounded memory
///
/// Keys come from requests, so an attacker could send endless distinct
/// ones. A compartment no call holds or waits on is idle and is evicted
/// (its counts go with it); eviction runs after every `max_keys / 8` new
/// keys, and on demand with [`evict_idle`](Self::evict_idle). At most
/// `max_keys` keys are tracked: when that many are busy, calls for further
/// keys share one *overflow* compartment with the same limits, so new keys
/// cannot grow memory nor take the slots of the tracked ones.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// use keel_policy::bulkhead::{Bulkhead, KeyedBulkhead};
///
/// let per_tenant: KeyedBulkhead<String> =
///     Bulkhead::builder("api").max_concurrent(2).build_keyed().unwrap();
/// let answer = per_tenant
///     .call(&"acme".to_string(), || async { Ok::<_, std::io::Error>(42) })
///     .await;
/// assert_eq!(answer.unwrap(), 42);
/// # });
/// ```
pub struct KeyedBulkhead<K> {
    shared: Arc<KeyedShared<K>>,
}

struct KeyedShared<K> {
    rules: Rules,
    max_keys: usize,
    evict_every: usize,
    compartments: RwLock<HashMap<K, Arc<Compartment>>>,
    overflow: Arc<Compartment>,
    new_keys_since_eviction: AtomicUsize,
    overflow_total: metrics::Counter,
}

impl<K: Hash + Eq + Clone> KeyedBulkhead<K> {
    pub(super) fn from_config(name: Name, config: &BulkheadConfig) -> Self {
        let overflow_total =
            metrics::counter!("keel_bulkhead_overflow_total", "name" => name.as_str());
        let rules = Rules::new(name, config);
        let overflow = Arc::new(Compartment::new(&rules));
        let shared = KeyedShared {
            rules,
            max_keys: config.max_keys,
            evict_every: (config.max_keys / 8).max(1),
            compartments: RwLock::new(HashMap::new()),
            overflow,
            new_keys_since_eviction: AtomicUsize::new(0),
            overflow_total,
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Runs `f` in a slot of `key`'s compartment, or refuses with
    /// [`Rejected::BulkheadFull`](keel_core::Rejected::BulkheadFull) (or
    /// `DeadlineExceeded` if the deadline passes while waiting).
    pub async fn call<T, E, F, Fut>(&self, key: &K, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let compartment = self.compartment(key);
        let _slot = compartment.enter(&self.shared.rules).await?;
        f().await.map_err(PolicyError::Inner)
    }

    /// Takes a free slot in `key`'s compartment without waiting, for the
    /// tower service.
    pub(super) fn try_enter_owned(&self, key: &K) -> Result<Slot, Rejected> {
        let compartment = self.compartment(key);
        compartment
            .try_enter_owned()
            .ok_or_else(|| compartment.refuse_full(&self.shared.rules))
    }

    /// The counts of `key`'s compartment, if it is tracked.
    pub fn stats(&self, key: &K) -> Option<BulkheadStats> {
        let compartments = self.shared.compartments.read();
        let max = self.shared.rules.max_concurrent;
        compartments.get(key).map(|c| c.stats(max))
    }

    /// The counts of the compartment shared by keys beyond `max_keys`.
    pub fn overflow_stats(&self) -> BulkheadStats {
        self.shared.overflow.stats(self.shared.rules.max_concurrent)
    }

    /// How many keys are tracked now (never more than `max_keys`).
    pub fn len(&self) -> usize {
        self.shared.compartments.read().len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every key no call holds or waits on; returns how many.
    /// Run it on a schedule to give memory back between bursts of keys.
    pub fn evict_idle(&self) -> usize {
        let mut compartments = self.shared.compartments.write();
        self.evict_idle_locked(&mut compartments)
    }

    /// The bulkhead's name.
    pub fn name(&self) -> &Name {
        &self.shared.rules.name
    }

    fn compartment(&self, key: &K) -> Arc<Compartment> {
        if let Some(found) = self.shared.compartments.read().get(key) {
            return Arc::clone(found);
        }
        self.track(key)
    }

    fn track(&self, key: &K) -> Arc<Compartment> {
        let shared = &*self.shared;
        let mut compartments = shared.compartments.write();
        if let Some(found) = compartments.get(key) {
            return Arc::clone(found);
        }
        if shared.new_keys_since_eviction.fetch_add(1, Relaxed) + 1 >= shared.evict_every {
            self.evict_idle_locked(&mut compartments);
        }
        if compartments.len() >= shared.max_keys {
            shared.overflow_total.increment(1);
            tracing::debug!(bulkhead = %shared.rules.name, "key table full; using the overflow compartment");
            return Arc::clone(&shared.overflow);
        }
        let compartment = Arc::new(Compartment::new(&shared.rules));
        compartments.insert(key.clone(), Arc::clone(&compartment));
        compartment
    }

    fn evict_idle_locked(&self, compartments: &mut HashMap<K, Arc<Compartment>>) -> usize {
        self.shared.new_keys_since_eviction.store(0, Relaxed);
        let before = compartments.len();
        compartments.retain(|_, compartment| !compartment.is_idle());
        before - compartments.len()
    }
}

impl<K> Clone for KeyedBulkhead<K> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K> fmt::Debug for KeyedBulkhead<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedBulkhead")
            .field("name", &self.shared.rules.name)
            .field("max_concurrent", &self.shared.rules.max_concurrent)
            .field("max_keys", &self.shared.max_keys)
            .finish_non_exhaustive()
    }
}
