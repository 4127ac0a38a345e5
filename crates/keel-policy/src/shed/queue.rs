//! A bounded work queue: producers wait or are refused when it is full, and
//! consumers never see an item whose deadline has passed.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Deadline, Name, Rejected};
use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

use super::{QueueBuilder, Telemetry};

/// A bounded multi-producer, multi-consumer work queue; see the
/// [module docs](super).
///
/// Clones are handles to the same queue.
pub struct BoundedQueue<T> {
    shared: Arc<Shared<T>>,
}

struct Shared<T> {
    items: Mutex<VecDeque<Entry<T>>>,
    /// One permit per free place; a producer takes one before pushing.
    space: Semaphore,
    filled: Notify,
    capacity: usize,
    retry_after: Duration,
    telemetry: Telemetry,
}

struct Entry<T> {
    item: T,
    deadline: Option<Deadline>,
}

/// An item the queue did not take, handed back with the reason.
#[derive(Debug)]
pub struct Refused<T> {
    /// The item, so the caller can answer for it.
    pub item: T,
    /// Why: [`Rejected::Overloaded`] from `try_put` on a full queue, or
    /// [`Rejected::DeadlineExceeded`] when the item's deadline passed first.
    pub rejected: Rejected,
}

/// A snapshot of a queue's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueStats {
    /// Items waiting now.
    pub len: usize,
    /// The most items it holds.
    pub capacity: usize,
    /// Items refused by `try_put` on a full queue.
    pub shed: u64,
    /// Items dropped because their deadline passed, in the queue or while
    /// waiting to enter it.
    pub expired: u64,
}

impl BoundedQueue<()> {
    /// Starts building a queue named `name`; the item type is chosen by
    /// [`build`](QueueBuilder::build).
    pub fn builder(name: impl Into<Name>) -> QueueBuilder {
        QueueBuilder::new(name.into())
    }
}

impl<T> BoundedQueue<T> {
    pub(super) fn new(name: Name, capacity: usize, retry_after: Duration) -> Self {
        let shared = Shared {
            items: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
            space: Semaphore::new(capacity),
            filled: Notify::new(),
            capacity,
            retry_after,
            telemetry: Telemetry::new(name),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Adds `item`, waiting while the queue is full: that wait is the
    /// backpressure. The item carries the current [`Deadline`], if any; if
    /// it passes before there is room, the item is handed back.
    pub async fn put(&self, item: T) -> Result<(), Refused<T>> {
        self.put_until(item, Deadline::current()).await
    }

    /// Like [`put`](Self::put), with an explicit deadline for the item.
    pub async fn put_until(&self, item: T, deadline: Option<Deadline>) -> Result<(), Refused<T>> {
        if deadline.is_some_and(|d| d.is_expired()) {
            return Err(self.expired(item));
        }
        let space = &self.shared.space;
        let permit = match deadline {
            None => space.acquire().await.ok(),
            Some(deadline) => tokio::time::timeout_at(deadline.instant(), space.acquire())
                .await
                .ok()
                .and_then(Result::ok),
        };
        match permit {
            Some(permit) => {
                permit.forget();
                self.push(Entry { item, deadline });
                Ok(())
            }
            None => Err(self.expired(item)),
        }
    }

    /// Adds `item` if there is room now; otherwise sheds it, counted in
    /// `keel_shed_total`, with [`Rejected::Overloaded`]. For producers that
    /// cannot be made to wait.
    pub fn try_put(&self, item: T) -> Result<(), Refused<T>> {
        self.try_put_until(item, Deadline::current())
    }

    /// Like [`try_put`](Self::try_put), with an explicit deadline.
    pub fn try_put_until(&self, item: T, deadline: Option<Deadline>) -> Result<(), Refused<T>> {
        match self.shared.space.try_acquire() {
            Ok(permit) => {
                permit.forget();
                self.push(Entry { item, deadline });
                Ok(())
            }
            Err(_) => {
                let rejected = self.shared.telemetry.shed(self.shared.retry_after);
                Err(Refused { item, rejected })
            }
        }
    }

    /// Takes the oldest item whose deadline has not passed, waiting for one.
    /// Expired items are dropped on the way, counted in
    /// `keel_shed_expired_total`: there is no point doing dead work.
    pub async fn get(&self) -> T {
        loop {
            let filled = self.shared.filled.notified();
            tokio::pin!(filled);
            // Register before looking, so an item pushed in between wakes us.
            filled.as_mut().enable();
            if let Some(item) = self.try_get() {
                return item;
            }
            filled.await;
        }
    }

    /// Takes the oldest live item if there is one, without waiting.
    pub fn try_get(&self) -> Option<T> {
        loop {
            let entry = self.shared.items.lock().pop_front()?;
            self.shared.space.add_permits(1);
            if entry.deadline.is_some_and(|d| d.is_expired()) {
                self.shared.telemetry.expire();
                continue;
            }
            return Some(entry.item);
        }
    }

    /// How many items wait now.
    pub fn len(&self) -> usize {
        self.shared.items.lock().len()
    }

    /// Whether no item waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most items the queue holds.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// The current counts.
    pub fn stats(&self) -> QueueStats {
        QueueStats {
            len: self.len(),
            capacity: self.shared.capacity,
            shed: self.shared.telemetry.shed_count(),
            expired: self.shared.telemetry.expired_count(),
        }
    }

    fn push(&self, entry: Entry<T>) {
        self.shared.items.lock().push_back(entry);
        self.shared.filled.notify_one();
    }

    fn expired(&self, item: T) -> Refused<T> {
        self.shared.telemetry.expire();
        Refused {
            item,
            rejected: Rejected::DeadlineExceeded,
        }
    }
}

impl<T> Clone for BoundedQueue<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<T> fmt::Debug for BoundedQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundedQueue")
            .field("name", &self.shared.telemetry.name)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<T> fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.rejected, f)
    }
}

impl<T: fmt::Debug> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.rejected)
    }
}
