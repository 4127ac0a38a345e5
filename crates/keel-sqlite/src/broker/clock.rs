//! The broker's notion of "now" as Unix milliseconds.
//!
//! Rows need wall-clock times (several processes may share the database
//! file), but Keel reads monotonic time from tokio's clock so tests can pause
//! it. The broker clock is both: wall-clock milliseconds anchored once, when
//! the broker opens, and advanced by tokio's clock from then on.

use std::time::Duration;

use keel_core::clock::{self, Instant};

/// Wall-clock milliseconds that advance with tokio's clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct BrokerClock {
    anchor_unix_ms: i64,
    anchor: Instant,
}

impl BrokerClock {
    /// A clock anchored at the current wall-clock time.
    pub(super) fn new() -> Self {
        Self {
            anchor_unix_ms: i64::try_from(clock::unix_millis()).unwrap_or(i64::MAX),
            anchor: clock::now(),
        }
    }

    /// Now, in Unix milliseconds.
    pub(super) fn now_ms(&self) -> i64 {
        self.anchor_unix_ms
            .saturating_add(millis(clock::now().saturating_duration_since(self.anchor)))
    }

    /// The monotonic instant at which this clock reads `unix_ms`.
    pub(super) fn instant_at(&self, unix_ms: i64) -> Instant {
        let now_ms = self.now_ms();
        let now = clock::now();
        match u64::try_from(unix_ms.saturating_sub(now_ms)) {
            Ok(ahead) => now
                .checked_add(Duration::from_millis(ahead))
                .unwrap_or(now + Duration::from_secs(86_400)),
            Err(_) => now,
        }
    }
}

/// A duration in whole milliseconds, saturating.
pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn advances_with_tokio_time() {
        let clock = BrokerClock::new();
        let start = clock.now_ms();
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(clock.now_ms() - start, 5_000);
        let at = clock.instant_at(start + 7_000);
        assert_eq!(at - clock::now(), Duration::from_secs(2));
        assert_eq!(clock.instant_at(start), clock::now(), "the past is now");
    }
}
