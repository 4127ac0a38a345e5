//! governor's view of time, read from tokio's clock.

use governor::clock::{Clock, ReasonablyRealtime};
use governor::nanos::Nanos;
use keel_core::clock;
use tokio::time::Instant;

/// A [`governor`] clock that reads [`keel_core::clock::now`], so rate limits
/// follow `tokio::time::pause()` and `advance()` in tests.
///
/// It counts nanoseconds from its creation; create it (and the limiter
/// using it) inside the runtime whose clock it should follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokioClock {
    origin: Instant,
}

impl TokioClock {
    /// A clock counting from now.
    pub fn new() -> Self {
        Self {
            origin: clock::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    type Instant = Nanos;

    #[inline]
    fn now(&self) -> Nanos {
        let elapsed = clock::now().saturating_duration_since(self.origin);
        Nanos::from(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl ReasonablyRealtime for TokioClock {}
