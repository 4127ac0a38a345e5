//! [`LongPoll`]: the client half of long polling (`GET ?after=<cursor>` →
//! `200 {events, cursor}` or `204`), as Keel's realtime server speaks it.
//!
//! The long-poll client loop, done once:
//!
//! - **keep the cursor**: every batch moves it to the batch's `cursor`, and
//!   the next poll asks for what came after it, so a reconnect misses
//!   nothing and repeats nothing;
//! - **`204` is success**: nothing happened within the server's poll
//!   timeout; poll again at once, with no delay and no failure counted
//!   (unless it came back within a second: a server, or a deadline about
//!   to pass, that answers `204` at once would otherwise be asked in a
//!   tight loop, so that waits the reconnect delay);
//! - **reconnect with full jitter**: a refused connection, a `5xx`, a `503`
//!   from a draining server or a connection dropped mid-poll waits a
//!   jittered, growing delay ([`Reconnect`]), and at least the server's
//!   `Retry-After`;
//! - **stop** on the current [`Deadline`](keel_core::Deadline) (no wait
//!   starts that would outlast it) or when the caller drops the future:
//!   the cursor only moves when a batch is returned, so a dropped
//!   [`next`](LongPoll::next) loses nothing.
//!
//! A server that answers something other than the protocol (a body that is
//! not a batch, a cursor that goes backwards) is a [`LoopError::Protocol`]
//! at once, and the next call waits before it asks again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::loop_error::{after_call_failure, after_failed_answer, after_garbage, read_body};
use crate::reconnect::ReconnectState;
use crate::{LoopError, PropagatingClient, Reconnect};

/// How long one poll may take before the client gives up on it: 35 s, above
/// the server's 25 s poll timeout, so a quiet poll ends with its `204`.
pub const DEFAULT_POLL_REQUEST_TIMEOUT: Duration = Duration::from_secs(35);

/// A `204` sooner than this after the poll was sent is not a quiet poll
/// (the server waits seconds before it answers one): the consumer waits its
/// reconnect delay before the next poll instead of asking again at once.
const QUICK_NO_CONTENT: Duration = Duration::from_secs(1);

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PolledEvent {
    /// Its position in the stream; the cursor after it.
    pub seq: i64,
    /// The event's type (`order.shipped`).
    #[serde(rename = "type")]
    pub event_type: String,
    /// Its payload.
    pub data: serde_json::Value,
    /// When it was appended.
    pub at: DateTime<Utc>,
}

/// The events that came after the cursor, in order.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Batch {
    /// The events, oldest first; never empty.
    pub events: Vec<PolledEvent>,
    /// The cursor after this batch.
    pub cursor: i64,
    /// Retention removed events after the previous cursor before this
    /// client read them: something was missed, and the application should
    /// reload its state.
    #[serde(default)]
    pub truncated: bool,
}

/// A long-poll consumer of one URL. Build it with [`LongPoll::builder`].
///
/// ```no_run
/// use keel_client::{LongPoll, PropagatingClient};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = PropagatingClient::new(reqwest::Client::new());
/// let mut updates = LongPoll::builder(&client, "http://127.0.0.1:8080/updates".parse()?).build();
/// loop {
///     let batch = updates.next().await?;
///     for event in &batch.events {
///         println!("{} {}", event.seq, event.event_type);
///     }
///     // Save `updates.cursor()` to resume after a restart.
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct LongPoll {
    client: PropagatingClient,
    url: reqwest::Url,
    cursor: i64,
    reconnect: ReconnectState,
}

/// Configures a [`LongPoll`].
#[derive(Debug)]
pub struct LongPollBuilder {
    client: PropagatingClient,
    url: reqwest::Url,
    cursor: i64,
    request_timeout: Duration,
    reconnect: Reconnect,
}

impl LongPoll {
    /// A consumer of `url` (`?after=` is added to it), through `client`,
    /// from the start of the stream.
    pub fn builder(client: &PropagatingClient, url: reqwest::Url) -> LongPollBuilder {
        LongPollBuilder {
            client: client.clone(),
            url,
            cursor: 0,
            request_timeout: DEFAULT_POLL_REQUEST_TIMEOUT,
            reconnect: Reconnect::new(),
        }
    }

    /// The cursor: the seq of the last event returned (or the one it
    /// started from). Save it to resume after a restart.
    pub fn cursor(&self) -> i64 {
        self.cursor
    }

    /// The next batch of events: polls until one arrives, riding out `204`s
    /// and failures the [`Reconnect`] allows.
    ///
    /// # Errors
    ///
    /// See [`LoopError`]: the deadline, a refusal for good, an answer that
    /// is not the protocol, or too many failures in a row.
    pub async fn next(&mut self) -> Result<Batch, LoopError> {
        loop {
            self.reconnect.ready().await?;
            let mut url = self.url.clone();
            url.query_pairs_mut()
                .append_pair("after", &self.cursor.to_string());
            let request = self
                .client
                .inner()
                .get(url)
                .header(http::header::ACCEPT, "application/json");
            let asked = tokio::time::Instant::now();
            let response = match self.client.send(request).await {
                Ok(response) => response,
                Err(error) => {
                    after_call_failure(&mut self.reconnect, error)?;
                    continue;
                }
            };
            if response.status() == http::StatusCode::NO_CONTENT {
                if asked.elapsed() < QUICK_NO_CONTENT {
                    // Not a quiet poll: a server (or a deadline about to
                    // pass) that answers 204 at once would be polled in a
                    // tight loop. Wait as after a failure.
                    after_failed_answer(&mut self.reconnect)?;
                } else {
                    self.reconnect.succeeded();
                }
                continue;
            }
            match self.read_batch(response).await {
                Ok(Some(batch)) => {
                    self.reconnect.succeeded();
                    self.cursor = batch.cursor;
                    return Ok(batch);
                }
                Ok(None) => {
                    after_failed_answer(&mut self.reconnect)?;
                }
                Err(error) => return Err(after_garbage(&mut self.reconnect, error)),
            }
        }
    }

    async fn read_batch(&self, response: reqwest::Response) -> Result<Option<Batch>, LoopError> {
        let url = response.url().clone();
        if response.status() != http::StatusCode::OK {
            return Err(LoopError::protocol(
                url,
                format!("answered {}, not 200 or 204", response.status()),
            ));
        }
        let Some(body) = read_body(response).await? else {
            return Ok(None);
        };
        let batch: Batch = serde_json::from_slice(&body)
            .map_err(|error| LoopError::protocol(&url, format!("not a batch: {error}")))?;
        if batch.events.is_empty() || batch.cursor < self.cursor {
            return Err(LoopError::protocol(
                url,
                format!(
                    "a batch of {} events moving the cursor from {} to {}",
                    batch.events.len(),
                    self.cursor,
                    batch.cursor
                ),
            ));
        }
        Ok(Some(batch))
    }
}

impl LongPollBuilder {
    /// Starts after this cursor (a saved [`LongPoll::cursor`]); default 0,
    /// everything the server retains.
    #[must_use]
    pub fn after(mut self, cursor: i64) -> Self {
        self.cursor = cursor;
        self
    }

    /// How long one poll may take (default
    /// [`DEFAULT_POLL_REQUEST_TIMEOUT`]); keep it above the server's poll
    /// timeout. The current deadline shortens it.
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How the consumer waits after failures (default [`Reconnect::new`]).
    #[must_use]
    pub fn reconnect(mut self, reconnect: Reconnect) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// The consumer.
    pub fn build(self) -> LongPoll {
        LongPoll {
            client: self.client.timeout(self.request_timeout),
            url: self.url,
            cursor: self.cursor,
            reconnect: self.reconnect.start(),
        }
    }
}
