//! Where each message id was first seen lately: publisher dedupe on
//! arrival that tells a republish from a re-read.
//!
//! A republished message sits at another offset than its first copy; a
//! record read again (its partition came back after a rebalance, or the
//! member fetched it anew) sits at the same one. Only the first is a
//! duplicate, so the window remembers places, not just ids.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use keel_core::clock::{self, Instant};

use crate::held::Place;

/// Ids seen within a window, at most `capacity` of them (the oldest go
/// first), so a flood of distinct ids cannot grow it without bound.
pub(crate) struct RecentPlaces {
    window: Duration,
    capacity: usize,
    order: VecDeque<(Instant, String)>,
    places: HashMap<String, Place>,
}

impl RecentPlaces {
    pub(crate) fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity,
            order: VecDeque::new(),
            places: HashMap::new(),
        }
    }

    /// Whether `id` at `place` repeats a message first seen elsewhere
    /// within the window; otherwise remembers it there.
    pub(crate) fn is_duplicate(&mut self, id: &str, place: Place) -> bool {
        let now = clock::now();
        while let Some((at, _)) = self.order.front() {
            let full = self.order.len() >= self.capacity;
            if !full && now.saturating_duration_since(*at) < self.window {
                break;
            }
            if let Some((_, old)) = self.order.pop_front() {
                self.places.remove(&old);
            }
        }
        if self.capacity == 0 || self.window.is_zero() {
            return false;
        }
        match self.places.get(id) {
            Some(first) => *first != place,
            None => {
                self.places.insert(id.to_owned(), place);
                self.order.push_back((now, id.to_owned()));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_republish_is_a_duplicate_and_a_re_read_is_not() {
        let mut recent = RecentPlaces::new(Duration::from_secs(60), 10);
        assert!(!recent.is_duplicate("a", (0, 5)));
        assert!(recent.is_duplicate("a", (0, 9)), "republished");
        assert!(!recent.is_duplicate("a", (0, 5)), "read again");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(
            !recent.is_duplicate("a", (0, 9)),
            "forgotten after the window"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_bounds_what_is_remembered() {
        let mut recent = RecentPlaces::new(Duration::from_secs(60), 2);
        for (offset, id) in ["a", "b", "c"].into_iter().enumerate() {
            assert!(!recent.is_duplicate(id, (0, offset as i64)));
        }
        assert!(recent.places.len() <= 2);
        assert!(
            !recent.is_duplicate("a", (0, 7)),
            "the oldest was forgotten"
        );
    }
}
