//! The one place Keel reads time.
//!
//! Monotonic time comes from tokio's clock, so `tokio::time::pause()` freezes
//! every policy, deadline and worker together and tests with clocks run in
//! microseconds. The wall clock is only needed where a time crosses a process
//! boundary (a deadline header, a webhook timestamp).

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use tokio::time::Instant;

/// The current monotonic instant (tokio's clock, pausable in tests).
#[inline]
pub fn now() -> Instant {
    Instant::now()
}

/// Runs `job` at once and then every `period` until `shutdown` completes,
/// by tokio's clock (so a paused test drives it). A tick missed while `job`
/// ran is delayed, not bunched up; a run in progress finishes before
/// `shutdown` is noticed. Keel's background jobs (prunes, sweeps, gauge
/// reads) all run on this loop.
pub async fn every<F, Fut>(period: Duration, shutdown: impl Future<Output = ()>, mut job: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => job().await,
        }
    }
}

/// The current wall-clock time.
#[allow(clippy::disallowed_methods)] // the one sanctioned read of the wall clock
pub fn system_now() -> SystemTime {
    SystemTime::now()
}

/// The current wall-clock time as a UTC timestamp, the type stored rows and
/// envelopes carry. Read it here, not with `chrono::Utc::now`, so that the
/// wall clock has one reader.
pub fn utc_now() -> chrono::DateTime<chrono::Utc> {
    system_now().into()
}

/// Milliseconds since the Unix epoch, by the wall clock (0 if the clock is
/// set before 1970).
pub fn unix_millis() -> u64 {
    system_now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Seconds since the Unix epoch, by the wall clock.
pub fn unix_seconds() -> u64 {
    unix_millis() / 1000
}

/// Converts a wall-clock time in Unix milliseconds into a monotonic instant,
/// using the offset between the two clocks now. Times in the past saturate
/// towards the earliest representable instant.
pub fn instant_from_unix_millis(unix_ms: u64) -> Instant {
    let now_ms = unix_millis();
    let now = now();
    if unix_ms >= now_ms {
        let ahead = Duration::from_millis(unix_ms - now_ms);
        now.checked_add(ahead)
            .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
    } else {
        now.checked_sub(Duration::from_millis(now_ms - unix_ms))
            .unwrap_or(now)
    }
}

/// Converts a monotonic instant into wall-clock Unix milliseconds.
pub fn unix_millis_from_instant(at: Instant) -> u64 {
    let now_ms = unix_millis();
    let now = now();
    if at >= now {
        let ahead = u64::try_from((at - now).as_millis()).unwrap_or(u64::MAX);
        now_ms.saturating_add(ahead)
    } else {
        let behind = u64::try_from((now - at).as_millis()).unwrap_or(u64::MAX);
        now_ms.saturating_sub(behind)
    }
}
