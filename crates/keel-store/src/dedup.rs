//! A bounded in-memory dedupe window, for consumers whose effect has no
//! transaction to put an inbox row in.
//!
//! The inbox (`InboxStore`, feature `inbox`) is the exact answer
//! to at-least-once delivery: the dedupe row and the effect commit together.
//! Some effects cannot join a transaction (a cache write, a push
//! notification, a call to an API without idempotency keys). For those, a
//! [`DedupWindow`] remembers the ids it saw recently and reports repeats.
//!
//! It is bounded twice, because either bound alone fails:
//!
//! - by **time** ([`ttl`](DedupWindow::ttl)): redeliveries and relay
//!   republishes arrive within a lease or a backoff of the original, so an
//!   id older than that is not worth keeping;
//! - by **count** ([`capacity`](DedupWindow::capacity)): under a burst the
//!   time bound alone would let memory grow with the arrival rate.
//!
//! An id is forgotten when it passes *either* bound, oldest first, in O(1)
//! amortised time per call. It is best-effort by construction: a duplicate
//! arriving after its id was evicted, or after a restart, gets through. So
//! the effect must still tolerate a rare duplicate; the window only makes
//! them rare.
//!
//! ```
//! use std::num::NonZeroUsize;
//! use std::time::Duration;
//! use keel_store::dedup::DedupWindow;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let mut seen = DedupWindow::new(Duration::from_secs(600), NonZeroUsize::new(10_000).unwrap());
//! assert!(seen.check_and_insert("evt-1"));   // new: do the work
//! assert!(!seen.check_and_insert("evt-1"));  // redelivery: skip it
//! # });
//! ```

use std::collections::{HashSet, VecDeque};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};

/// The default time an id is remembered: 10 minutes, well past a broker
/// lease (30 s) plus the longest redelivery backoff (10 s) several times over.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);

/// The default most ids remembered at once.
pub const DEFAULT_CAPACITY: usize = 10_000;

/// Remembers recently seen ids, bounded by age and by count.
///
/// Not synchronised: share one between tasks behind a
/// `parking_lot::Mutex` (every call is short and never awaits).
#[derive(Debug, Clone)]
pub struct DedupWindow {
    ttl: Duration,
    capacity: NonZeroUsize,
    seen: HashSet<Arc<str>>,
    /// Ids in insertion order, which is also time order (monotonic clock).
    order: VecDeque<(Instant, Arc<str>)>,
}

impl Default for DedupWindow {
    /// [`DEFAULT_TTL`] and [`DEFAULT_CAPACITY`].
    fn default() -> Self {
        Self::new(
            DEFAULT_TTL,
            NonZeroUsize::new(DEFAULT_CAPACITY).unwrap_or(NonZeroUsize::MIN),
        )
    }
}

impl DedupWindow {
    /// A window remembering each id for `ttl`, and at most `capacity` ids.
    pub fn new(ttl: Duration, capacity: NonZeroUsize) -> Self {
        Self {
            ttl,
            capacity,
            seen: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// How long an id is remembered.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The most ids remembered at once.
    pub fn capacity(&self) -> NonZeroUsize {
        self.capacity
    }

    /// `true` if `id` is new (do the work), `false` if it was seen within
    /// the window (a duplicate: skip it). A new id is remembered from now.
    pub fn check_and_insert(&mut self, id: &str) -> bool {
        let now = clock::now();
        self.evict_expired(now);
        if self.seen.contains(id) {
            return false;
        }
        while self.order.len() >= self.capacity.get() {
            self.evict_oldest();
        }
        let id: Arc<str> = Arc::from(id);
        self.seen.insert(Arc::clone(&id));
        self.order.push_back((now, id));
        true
    }

    /// Whether `id` was seen within the window, without remembering it.
    pub fn contains(&mut self, id: &str) -> bool {
        self.evict_expired(clock::now());
        self.seen.contains(id)
    }

    /// How many ids are remembered now (expired ones included until the
    /// next call evicts them).
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no id is remembered.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Forgets every id.
    pub fn clear(&mut self) {
        self.seen.clear();
        self.order.clear();
    }

    fn evict_expired(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.ttl {
                break;
            }
            self.evict_oldest();
        }
    }

    fn evict_oldest(&mut self) {
        if let Some((_, id)) = self.order.pop_front() {
            self.seen.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(ttl_ms: u64, capacity: usize) -> DedupWindow {
        DedupWindow::new(
            Duration::from_millis(ttl_ms),
            NonZeroUsize::new(capacity).unwrap(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn repeats_within_the_window_are_duplicates() {
        let mut w = window(1_000, 10);
        assert!(w.check_and_insert("a"));
        assert!(w.check_and_insert("b"));
        assert!(!w.check_and_insert("a"));
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!w.check_and_insert("a"), "still inside the window");
        assert_eq!(w.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn ids_are_forgotten_after_the_ttl() {
        let mut w = window(1_000, 10);
        assert!(w.check_and_insert("a"));
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(w.check_and_insert("b"));
        tokio::time::advance(Duration::from_millis(500)).await;
        // `a` is exactly one ttl old: gone; `b` is half a ttl old: kept.
        assert!(!w.contains("a"));
        assert!(w.contains("b"));
        assert_eq!(w.len(), 1);
        assert!(w.check_and_insert("a"), "a forgotten id counts as new");
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_id_goes_when_the_count_is_reached() {
        let mut w = window(60_000, 3);
        for id in ["a", "b", "c", "d"] {
            assert!(w.check_and_insert(id));
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(w.len(), 3);
        assert!(!w.contains("a"), "evicted by the count bound");
        assert!(w.contains("b") && w.contains("c") && w.contains("d"));
    }

    #[tokio::test(start_paused = true)]
    async fn duplicates_do_not_extend_an_ids_life() {
        let mut w = window(1_000, 10);
        assert!(w.check_and_insert("a"));
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(!w.check_and_insert("a"));
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(
            w.check_and_insert("a"),
            "remembered from its first sighting"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn memory_stays_bounded_under_a_stream_of_new_ids() {
        let mut w = window(1_000, 100);
        for i in 0..10_000 {
            assert!(w.check_and_insert(&i.to_string()));
            assert!(w.len() <= 100);
            assert_eq!(w.seen.len(), w.order.len());
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(w.check_and_insert("fresh"));
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn default_bounds() {
        let w = DedupWindow::default();
        assert_eq!(w.ttl(), DEFAULT_TTL);
        assert_eq!(w.capacity().get(), DEFAULT_CAPACITY);
        assert!(w.is_empty());
    }
}
