//! [`FailureThrottle`]: too many failed credentials from one address, and
//! that address waits.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

/// Failures allowed per address and window by default: 10.
pub const DEFAULT_MAX_FAILURES: u32 = 10;

/// The window failures are counted over by default: one minute.
pub const DEFAULT_FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// Addresses remembered at most; when full, windows that ended are
/// forgotten first, then the oldest.
const MAX_TRACKED: usize = 10_000;

/// An address that failed too often, and how long it must wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("too many failed attempts from this address; retry in {} s", retry_after.as_secs().max(1))]
pub struct Throttled {
    /// When the window ends.
    pub retry_after: Duration,
}

/// Counts failed credentials per client address in fixed windows: after
/// `max_failures` in one window, every attempt from that address is
/// refused until the window ends, right or wrong, so guessing is bounded
/// at `max_failures` per window. Requests whose address is unknown share
/// one bucket. Cheap to clone; clones share the counts.
///
/// ```
/// use std::time::Duration;
/// use keel_http::access::FailureThrottle;
///
/// let throttle = FailureThrottle::new(2, Duration::from_secs(60));
/// let ip = Some("192.0.2.7".parse().unwrap());
/// throttle.fail(ip);
/// throttle.fail(ip);
/// assert!(throttle.check(ip).is_err());
/// assert!(throttle.check(Some("192.0.2.8".parse().unwrap())).is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct FailureThrottle {
    max_failures: u32,
    window: Duration,
    windows: Arc<Mutex<Windows>>,
}

/// Per address (or the shared unknown bucket): when its window began, and
/// its failures in it.
type Windows = HashMap<Option<IpAddr>, (Instant, u32)>;

impl Default for FailureThrottle {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FAILURES, DEFAULT_FAILURE_WINDOW)
    }
}

impl FailureThrottle {
    /// At most `max_failures` (at least 1) per address per `window`.
    pub fn new(max_failures: u32, window: Duration) -> Self {
        Self {
            max_failures: max_failures.max(1),
            window,
            windows: Arc::default(),
        }
    }

    /// Refuses an address that has used up its failures in this window.
    pub fn check(&self, ip: Option<IpAddr>) -> Result<(), Throttled> {
        let now = clock::now();
        let windows = self.windows.lock();
        match windows.get(&ip) {
            Some((start, failures))
                if *failures >= self.max_failures && now < *start + self.window =>
            {
                Err(Throttled {
                    retry_after: (*start + self.window).saturating_duration_since(now),
                })
            }
            _ => Ok(()),
        }
    }

    /// Counts one failure for the address.
    pub fn fail(&self, ip: Option<IpAddr>) {
        metrics::counter!("keel_auth_failures_total").increment(1);
        let now = clock::now();
        let mut windows = self.windows.lock();
        if windows.len() >= MAX_TRACKED && !windows.contains_key(&ip) {
            let window = self.window;
            windows.retain(|_, (start, _)| now < *start + window);
            if windows.len() >= MAX_TRACKED
                && let Some(oldest) = windows.iter().min_by_key(|(_, (s, _))| *s).map(|(k, _)| *k)
            {
                windows.remove(&oldest);
            }
        }
        let entry = windows.entry(ip).or_insert((now, 0));
        if now >= entry.0 + self.window {
            *entry = (now, 0);
        }
        entry.1 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_address_that_fails_too_often_waits_for_its_window_to_end() {
        let throttle = FailureThrottle::new(3, Duration::from_secs(60));
        let ip = Some("198.51.100.1".parse().unwrap());
        for _ in 0..3 {
            assert!(throttle.check(ip).is_ok());
            throttle.fail(ip);
        }
        let refused = throttle.check(ip).unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(60));
        assert!(throttle.check(None).is_ok(), "other buckets are untouched");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(throttle.check(ip).is_ok(), "a new window");
        throttle.fail(ip);
        assert!(throttle.check(ip).is_ok(), "counting starts again");
    }
}
