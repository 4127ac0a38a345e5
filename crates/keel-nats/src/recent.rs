//! A bounded memory of per-key facts, for caches whose entries are only
//! hints: forgetting one costs a round trip to the server, never a wrong
//! answer.
//!
//! Keys are message keys, so a consumer or publisher that sees a new key
//! per order would otherwise keep every key it ever saw. Two generations
//! bound it without bookkeeping per lookup: writes go to the current one;
//! when it is full it becomes the previous one and the old previous one is
//! dropped. A key written within the last `capacity` distinct writes is
//! always still there.

use std::collections::HashMap;

/// Up to two generations of `capacity` entries each.
#[derive(Debug)]
pub(crate) struct Recent<V> {
    current: HashMap<String, V>,
    previous: HashMap<String, V>,
    capacity: usize,
}

impl<V: Copy> Recent<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity,
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<V> {
        self.current
            .get(key)
            .or_else(|| self.previous.get(key))
            .copied()
    }

    pub(crate) fn insert(&mut self, key: &str, value: V) {
        if let Some(slot) = self.current.get_mut(key) {
            *slot = value;
            return;
        }
        if self.current.len() >= self.capacity {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key.to_owned(), value);
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_stays_bounded_and_recent_keys_survive_a_rotation() {
        let mut recent = Recent::new(4);
        for n in 0..4 {
            recent.insert(&format!("k{n}"), n);
        }
        recent.insert("k0", 10);
        assert_eq!(
            recent.get("k0"),
            Some(10),
            "a known key is updated in place"
        );
        recent.insert("k4", 4);
        assert_eq!(
            recent.get("k0"),
            Some(10),
            "the previous generation still answers"
        );
        assert_eq!(recent.get("k4"), Some(4));
        for n in 5..9 {
            recent.insert(&format!("k{n}"), n);
        }
        assert_eq!(recent.get("k0"), None, "two rotations forget");
        assert_eq!(recent.get("k8"), Some(8));
        assert!(recent.len() <= 8);
    }

    #[test]
    fn the_current_generation_shadows_the_previous() {
        let mut recent = Recent::new(1);
        recent.insert("a", 1);
        recent.insert("b", 2);
        recent.insert("a", 3);
        assert_eq!(recent.get("a"), Some(3));
    }
}
