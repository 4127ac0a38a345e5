//! Waiting for something another task does, without a fixed sleep.

use std::future::Future;
use std::time::Duration;

/// How often [`eventually`] checks.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `check` every 20 ms until it holds.
///
/// # Panics
///
/// If it does not hold within `within`, naming `what` it waited for.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let give_up = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < give_up,
            "timed out after {within:?} waiting for: {what}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
