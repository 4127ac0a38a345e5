//! [`Reconnect`]: how the client loops (long poll, SSE, WebSocket, job
//! polling) wait before they try a server again, and when they give up.
//!
//! A loop that reconnects at once hammers a server that is restarting, and
//! every client it dropped comes back in the same instant. So each failure
//! waits a delay drawn from a [`Backoff`] (by default: 200 ms
//! doubling up to 10 s, **full jitter**), and at least as long as the
//! server's `Retry-After` when it sent one. The count of failures resets
//! only once the server has answered something useful (a batch, an event, a
//! message), not on a mere connection: a server that accepts and then hangs
//! up at once still sees the delays grow. A wait that would outlast the
//! current [`Deadline`] is not started: the loop stops with
//! [`Rejected::DeadlineExceeded`] instead.

use std::time::Duration;

use keel_core::{Deadline, Rejected};
use tokio::time::Instant;

/// The delays' shape and randomness, re-exported so a client loop can be
/// configured without naming `keel-policy`.
pub use keel_policy::retry::{Backoff, Jitter};

/// How a client loop waits between failed attempts, and how many it makes
/// before it gives up. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use keel_client::Reconnect;
/// use keel_client::reconnect::{Backoff, Jitter};
///
/// let reconnect = Reconnect::new()
///     .backoff(Backoff::exponential(Duration::from_millis(50), 2.0, Duration::from_secs(5))?
///         .with_jitter(Jitter::Full)?)
///     .max_failures(20);
/// # let _ = reconnect;
/// # Ok::<(), keel_policy::ConfigError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Reconnect {
    backoff: Backoff,
    max_failures: Option<u32>,
}

impl Reconnect {
    /// The default: [`Backoff::default`] (200 ms × 2ⁿ up to 10 s, full
    /// jitter), and no limit on failures in a row: the loop keeps trying
    /// until its deadline or until it is dropped.
    pub fn new() -> Self {
        Self::default()
    }

    /// The delays between failed attempts.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Gives up after this many failures in a row (at least 1).
    #[must_use]
    pub fn max_failures(mut self, failures: u32) -> Self {
        self.max_failures = Some(failures.max(1));
        self
    }

    pub(crate) fn start(&self) -> ReconnectState {
        ReconnectState {
            config: self.clone(),
            failures: 0,
            resume_at: None,
        }
    }
}

/// The failures so far of one loop, and when it may try again.
#[derive(Debug)]
pub(crate) struct ReconnectState {
    config: Reconnect,
    failures: u32,
    resume_at: Option<Instant>,
}

/// The loop failed `failures` times in a row, its limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GaveUp {
    pub(crate) failures: u32,
}

impl ReconnectState {
    /// The server answered something useful: the next failure starts the
    /// delays over.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
        self.resume_at = None;
    }

    /// An attempt failed: schedules the next one, at least `retry_after`
    /// from now, or gives up.
    pub(crate) fn failed(&mut self, retry_after: Option<Duration>) -> Result<(), GaveUp> {
        self.failures = self.failures.saturating_add(1);
        if self
            .config
            .max_failures
            .is_some_and(|max| self.failures >= max)
        {
            return Err(GaveUp {
                failures: self.failures,
            });
        }
        let jittered = self
            .config
            .backoff
            .delay(self.failures - 1)
            .unwrap_or_else(|| self.config.backoff.max_delay());
        let delay = retry_after.map_or(jittered, |asked| asked.max(jittered));
        self.resume_at = Some(Instant::now() + delay);
        Ok(())
    }

    /// Waits until the next attempt may start. Cancel-safe: a dropped wait
    /// leaves the same resume time for the next call.
    pub(crate) async fn ready(&mut self) -> Result<(), Rejected> {
        let Some(at) = self.resume_at else {
            return Ok(());
        };
        sleep_until_within_deadline(at).await?;
        self.resume_at = None;
        Ok(())
    }
}

/// Sleeps until `at`, or refuses at once when the current [`Deadline`]
/// comes first: a wait that ends too late to do anything is not started.
pub(crate) async fn sleep_until_within_deadline(at: Instant) -> Result<(), Rejected> {
    if let Some(deadline) = Deadline::current()
        && deadline.instant() <= at
    {
        return Err(Rejected::DeadlineExceeded);
    }
    tokio::time::sleep_until(at).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(ms: u64) -> Reconnect {
        Reconnect::new().backoff(
            Backoff::exponential(Duration::from_millis(ms), 2.0, Duration::from_secs(1))
                .and_then(|b| b.with_jitter(Jitter::None))
                .expect("valid backoff"),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn delays_grow_and_reset_after_a_success() {
        let mut state = fixed(100).start();
        let started = Instant::now();
        state.failed(None).expect("no limit");
        state.ready().await.expect("no deadline");
        assert_eq!(started.elapsed(), Duration::from_millis(100));
        state.failed(None).expect("no limit");
        state.ready().await.expect("no deadline");
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        state.succeeded();
        state.failed(None).expect("no limit");
        state.ready().await.expect("no deadline");
        assert_eq!(started.elapsed(), Duration::from_millis(400));
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_longer_than_the_backoff_is_honoured() {
        let mut state = fixed(100).start();
        let started = Instant::now();
        state
            .failed(Some(Duration::from_secs(3)))
            .expect("no limit");
        state.ready().await.expect("no deadline");
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_past_the_deadline_is_not_started() {
        let mut state = fixed(500).start();
        state.failed(None).expect("no limit");
        let started = Instant::now();
        let waited = Deadline::after(Duration::from_millis(200))
            .scope(state.ready())
            .await;
        assert_eq!(waited, Err(Rejected::DeadlineExceeded));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[test]
    fn it_gives_up_at_the_limit() {
        let mut state = fixed(1).max_failures(2).start();
        assert!(state.failed(None).is_ok());
        let gave_up = state
            .failed(None)
            .expect_err("the second failure is the limit");
        assert_eq!(gave_up.failures, 2);
    }
}
