//! governor's keyed state, capped at `max_keys` keys.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use governor::nanos::Nanos;
use governor::state::keyed::{DashMapStateStore, ShrinkableKeyedStateStore};
use governor::state::{InMemoryState, NotKeyed, StateStore};

/// One GCRA state per key, at most `max_keys` of them; keys beyond share
/// `overflow`. Counts the keys it has not seen before, so its owner knows
/// when to evict idle ones.
pub(super) struct KeyTable<K: Hash + Eq + Clone> {
    states: DashMapStateStore<K>,
    overflow: InMemoryState,
    max_keys: usize,
    new_keys: Arc<AtomicUsize>,
    overflow_total: metrics::Counter,
}

impl<K: Hash + Eq + Clone> KeyTable<K> {
    pub(super) fn new(
        max_keys: usize,
        new_keys: Arc<AtomicUsize>,
        overflow_total: metrics::Counter,
    ) -> Self {
        Self {
            states: DashMapStateStore::default(),
            overflow: InMemoryState::default(),
            max_keys,
            new_keys,
            overflow_total,
        }
    }
}

impl<K: Hash + Eq + Clone> StateStore for KeyTable<K> {
    type Key = K;

    fn measure_and_replace<T, F, E>(&self, key: &K, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        if let Some(state) = self.states.get(key) {
            return state.measure_and_replace(&NotKeyed::NonKey, f);
        }
        self.new_keys.fetch_add(1, Relaxed);
        if self.states.len() >= self.max_keys {
            self.overflow_total.increment(1);
            return self.overflow.measure_and_replace(&NotKeyed::NonKey, f);
        }
        let state = self.states.entry(key.clone()).or_default();
        state.measure_and_replace(&NotKeyed::NonKey, f)
    }
}

impl<K: Hash + Eq + Clone> ShrinkableKeyedStateStore<K> for KeyTable<K> {
    fn retain_recent(&self, drop_below: Nanos) {
        ShrinkableKeyedStateStore::retain_recent(&self.states, drop_below);
    }

    fn shrink_to_fit(&self) {
        self.states.shrink_to_fit();
    }

    fn len(&self) -> usize {
        self.states.len()
    }

    fn is_empty(&self) -> bool {
        self.states.is_empty()
    }
}

impl<K: Hash + Eq + Clone> std::fmt::Debug for KeyTable<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("keys", &self.states.len())
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}
