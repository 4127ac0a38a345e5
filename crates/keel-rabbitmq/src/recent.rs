//! The ids a subscription saw lately: publisher dedupe on arrival.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// Ids seen within a window, at most `capacity` of them (the oldest go
/// first), so a flood of distinct ids cannot grow it without bound.
#[derive(Debug)]
pub(crate) struct RecentIds {
    window: Duration,
    capacity: usize,
    order: VecDeque<(Instant, String)>,
    ids: HashSet<String>,
}

impl RecentIds {
    pub(crate) fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity,
            order: VecDeque::new(),
            ids: HashSet::new(),
        }
    }

    /// Records `id` seen at `now`; false when it was already seen within
    /// the window (a duplicate).
    pub(crate) fn first_sight(&mut self, id: &str, now: Instant) -> bool {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < self.window && self.order.len() < self.capacity.max(1) {
                break;
            }
            if let Some((_, old)) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        if self.capacity == 0 || self.window.is_zero() {
            return true;
        }
        if !self.ids.insert(id.to_owned()) {
            return false;
        }
        self.order.push_back((now, id.to_owned()));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_within_the_window_is_a_duplicate() {
        let mut recent = RecentIds::new(Duration::from_secs(60), 10);
        let now = Instant::now();
        assert!(recent.first_sight("a", now));
        assert!(!recent.first_sight("a", now + Duration::from_secs(1)));
        assert!(recent.first_sight("a", now + Duration::from_secs(61)));
    }

    #[test]
    fn capacity_bounds_what_is_remembered() {
        let mut recent = RecentIds::new(Duration::from_secs(60), 2);
        let now = Instant::now();
        for id in ["a", "b", "c"] {
            assert!(recent.first_sight(id, now));
        }
        assert!(recent.ids.len() <= 2);
        assert!(recent.first_sight("a", now), "the oldest was forgotten");
    }
}
