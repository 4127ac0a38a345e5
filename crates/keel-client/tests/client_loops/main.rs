//! The client loops against Keel's own servers (keel-realtime's long poll,
//! SSE and WebSocket, keel-http's jobs) on a real SQLite file, with the
//! server killed mid-stream and restarted on the same address: nothing
//! missed, nothing duplicated. And against a server that answers garbage:
//! a typed error, never a tight loop.
//!
//! "Killed" means the server's whole runtime is shut down at once: every
//! connection is dropped without a goodbye, as when the process dies. The
//! log lives in the SQLite file, which outlives it.

mod garbage;
mod jobs;
mod long_poll;
mod server;
mod sse;
mod websocket;

use std::time::Duration;

use keel_client::Reconnect;
use keel_policy::retry::{Backoff, Jitter};

/// Short, jittered delays, so a restart is noticed within a test's time.
fn quick_reconnect() -> Reconnect {
    Reconnect::new().backoff(
        Backoff::exponential(Duration::from_millis(20), 2.0, Duration::from_millis(300))
            .and_then(|backoff| backoff.with_jitter(Jitter::Full))
            .expect("valid backoff"),
    )
}

/// How long any one step of these tests may take before it is a failure.
const STEP: Duration = Duration::from_secs(20);
