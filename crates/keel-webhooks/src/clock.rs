//! The wall clock the webhook sender and receiver read: the system's, or a
//! manual one that tests move by hand.
//!
//! Webhook times cross process boundaries (the signed `webhook-timestamp`,
//! a delivery's `next_attempt_at` in the store), so they are wall-clock
//! times, not tokio instants. A retry schedule of hours is tested by
//! advancing a [`WallClock::manual`] clock instead of waiting, and without
//! pausing tokio's clock, which would fire HTTP timeouts early while a real
//! loopback server is answering.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A wall clock: the system's ([`WallClock::system`], the default) or a
/// manual one ([`WallClock::manual`]). Cheap to clone; clones of a manual
/// clock share its time.
///
/// ```
/// use std::time::Duration;
/// use keel_webhooks::WallClock;
///
/// let clock = WallClock::manual(chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap());
/// clock.advance(Duration::from_secs(300));
/// assert_eq!(clock.unix_seconds(), 1_700_000_300);
/// ```
#[derive(Debug, Clone, Default)]
pub struct WallClock {
    manual: Option<Arc<AtomicI64>>,
}

impl WallClock {
    /// The system clock (`keel_core::clock`).
    pub fn system() -> Self {
        Self { manual: None }
    }

    /// A clock standing at `start` until moved with [`advance`](Self::advance)
    /// or [`set`](Self::set).
    pub fn manual(start: DateTime<Utc>) -> Self {
        Self {
            manual: Some(Arc::new(AtomicI64::new(start.timestamp_millis()))),
        }
    }

    /// Moves a manual clock forward (no effect on the system clock).
    pub fn advance(&self, by: Duration) {
        if let Some(ms) = &self.manual {
            let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
            ms.fetch_add(by, Ordering::SeqCst);
        }
    }

    /// Sets a manual clock (no effect on the system clock).
    pub fn set(&self, at: DateTime<Utc>) {
        if let Some(ms) = &self.manual {
            ms.store(at.timestamp_millis(), Ordering::SeqCst);
        }
    }

    /// Now, in milliseconds since the Unix epoch.
    pub fn unix_millis(&self) -> i64 {
        match &self.manual {
            Some(ms) => ms.load(Ordering::SeqCst),
            None => i64::try_from(keel_core::clock::unix_millis()).unwrap_or(i64::MAX),
        }
    }

    /// Now, in whole seconds since the Unix epoch.
    pub fn unix_seconds(&self) -> i64 {
        self.unix_millis().div_euclid(1000)
    }

    /// Now.
    pub fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.unix_millis()).unwrap_or_default()
    }
}
