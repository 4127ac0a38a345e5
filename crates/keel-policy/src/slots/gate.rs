//! Counted slots with a bounded wait queue: the admission core shared by the
//! bulkhead and load shedding.
//!
//! Taking and freeing a slot is one atomic operation each, with no lock,
//! which is what keeps the happy path cheap. Waiters are woken in order
//! when a slot frees, but a call that finds a slot free takes it even if
//! others wait (barging, as most mutexes allow); the wait's time bound caps
//! how long a waiter can lose out.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use tokio::sync::Notify;
use tokio::time::Instant;

/// Slots and the calls waiting for one.
#[derive(Debug)]
pub(crate) struct Gate {
    active: AtomicUsize,
    waiting: AtomicUsize,
    freed: Notify,
    max_active: usize,
    max_waiting: usize,
}

/// Why a wait for a slot ended without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shut {
    QueueFull,
    TimedOut,
}

// The orderings are SeqCst because a freeing call checks `waiting` after
// decrementing `active` while a waiter checks `active` after incrementing
// `waiting`: at least one of them must see the other, or a wakeup is lost.
impl Gate {
    pub(crate) fn new(max_active: usize, max_waiting: usize) -> Self {
        Self {
            active: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
            max_active,
            max_waiting,
        }
    }

    /// Takes a free slot, if there is one.
    #[inline]
    pub(crate) fn try_enter(&self) -> bool {
        self.active
            .fetch_update(SeqCst, SeqCst, |n| (n < self.max_active).then_some(n + 1))
            .is_ok()
    }

    /// Frees a slot taken with [`try_enter`](Self::try_enter) or
    /// [`wait`](Self::wait), waking a waiter if there is one.
    #[inline]
    pub(crate) fn leave(&self) {
        self.active.fetch_sub(1, SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            self.freed.notify_one();
        }
    }

    /// Whether the wait queue has room now.
    pub(crate) fn can_wait(&self) -> bool {
        self.waiting.load(SeqCst) < self.max_waiting
    }

    /// Waits in the queue for a slot until `until`. A cancelled waiter
    /// gives its place back.
    pub(crate) async fn wait(&self, until: Instant) -> Result<(), Shut> {
        let Some(_place) = QueuePlace::join(&self.waiting, self.max_waiting) else {
            return Err(Shut::QueueFull);
        };
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Register before looking, so a slot freed in between wakes us.
            freed.as_mut().enable();
            if self.try_enter() {
                return Ok(());
            }
            if tokio::time::timeout_at(until, freed).await.is_err() {
                return if self.try_enter() {
                    Ok(())
                } else {
                    Err(Shut::TimedOut)
                };
            }
        }
    }

    /// Slots taken now.
    pub(crate) fn active(&self) -> usize {
        self.active.load(SeqCst)
    }

    /// Calls waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(SeqCst)
    }
}

/// A place in the wait queue, given back when dropped.
struct QueuePlace<'a>(&'a AtomicUsize);

impl<'a> QueuePlace<'a> {
    fn join(waiting: &'a AtomicUsize, max: usize) -> Option<Self> {
        waiting
            .fetch_update(SeqCst, SeqCst, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| Self(waiting))
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}
