//! [`SseClient`]: Server-Sent Events with `Last-Event-ID` resume, outside a
//! browser.
//!
//! What `EventSource` does, for a Rust service (frames parsed by the
//! `eventsource-stream` crate):
//!
//! - **resume**: every event's `id` is remembered and sent back as
//!   `Last-Event-ID` on the next connection, so a dropped stream continues
//!   where it stopped: no gap, no duplicate (Keel's server replays exactly
//!   what followed);
//! - **the server's `retry`**: a stream that ended cleanly (a deploy, a
//!   drain) reconnects after the server's `retry` delay (Keel draws it per
//!   connection, so clients do not return together), or the jittered
//!   [`Reconnect`] delay after a failure, whichever is longer;
//! - **a dead connection is noticed**: Keel sends a keepalive comment
//!   every 15 s; a stream silent for the idle timeout (45 s) is dropped and
//!   reconnected;
//! - **`204` means stop**: the server asks the client not to reconnect
//!   ([`LoopError::Ended`]); a response that is not `text/event-stream`, or
//!   an event over the size limit (1 MiB), is a [`LoopError::Protocol`].

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use eventsource_stream::{EventStream, EventStreamError, Eventsource};
use futures_util::{Stream, StreamExt};
use http::{StatusCode, header};

use crate::loop_error::{after_call_failure, after_garbage};
use crate::reconnect::ReconnectState;
use crate::{LoopError, PropagatingClient, Reconnect};

/// How long a stream may stay silent (no event, no keepalive) before the
/// client drops it and reconnects: 45 s, three of Keel's keepalives.
pub const DEFAULT_SSE_IDLE_TIMEOUT: Duration = Duration::from_secs(45);

/// The most bytes one event may take on the wire: 1 MiB.
pub const DEFAULT_SSE_EVENT_LIMIT: usize = 1024 * 1024;

/// How long one connection may last before it is renewed: 1 hour. The
/// current deadline shortens it.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(3600);

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// Its `id`, or the last one before it when it has none (as
    /// `EventSource`'s `lastEventId`).
    pub id: Option<String>,
    /// Its `event` field (`message` when it has none).
    pub event: String,
    /// Its `data`, lines joined with `\n`.
    pub data: String,
}

/// A resuming SSE consumer of one URL. Build it with [`SseClient::builder`].
///
/// ```no_run
/// use keel_client::{PropagatingClient, SseClient};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = PropagatingClient::new(reqwest::Client::new());
/// let mut stream = SseClient::builder(&client, "http://127.0.0.1:8080/stream".parse()?).build();
/// loop {
///     let event = stream.next().await?;
///     println!("{:?} {} {}", event.id, event.event, event.data);
/// }
/// # }
/// ```
pub struct SseClient {
    client: PropagatingClient,
    url: reqwest::Url,
    last_event_id: Option<String>,
    reconnect: ReconnectState,
    idle_timeout: Duration,
    event_limit: usize,
    server_retry: Option<Duration>,
    open: Option<OpenStream>,
    ended: bool,
}

impl std::fmt::Debug for SseClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseClient")
            .field("url", &self.url.as_str())
            .field("last_event_id", &self.last_event_id)
            .field("connected", &self.open.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures an [`SseClient`].
#[derive(Debug)]
pub struct SseClientBuilder {
    client: PropagatingClient,
    url: reqwest::Url,
    last_event_id: Option<String>,
    reconnect: Reconnect,
    idle_timeout: Duration,
    event_limit: usize,
}

type Frames = Pin<Box<dyn Stream<Item = Result<bytes::Bytes, Fault>> + Send>>;

struct OpenStream {
    events: EventStream<Frames>,
    /// Bytes received since the last event.
    pending: Arc<AtomicUsize>,
}

/// Why the byte stream stopped.
#[derive(Debug)]
enum Fault {
    Transport(reqwest::Error),
    TooLarge,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Transport(error) => write!(f, "{error}"),
            Self::TooLarge => f.write_str("an event over the size limit"),
        }
    }
}

impl SseClient {
    /// A consumer of `url` through `client`, from the server's default
    /// start (Keel: everything retained).
    pub fn builder(client: &PropagatingClient, url: reqwest::Url) -> SseClientBuilder {
        SseClientBuilder {
            client: client.clone(),
            url,
            last_event_id: None,
            reconnect: Reconnect::new(),
            idle_timeout: DEFAULT_SSE_IDLE_TIMEOUT,
            event_limit: DEFAULT_SSE_EVENT_LIMIT,
        }
    }

    /// The id the next connection sends as `Last-Event-ID`. Save it to
    /// resume after a restart.
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_event_id.as_deref()
    }

    /// The next event, reconnecting as needed. Cancel-safe: an event is
    /// either returned or read again after the resume.
    ///
    /// # Errors
    ///
    /// See [`LoopError`]; [`LoopError::Ended`] once the server answered
    /// `204`, for this call and every later one.
    pub async fn next(&mut self) -> Result<SseEvent, LoopError> {
        loop {
            if self.ended {
                return Err(LoopError::Ended);
            }
            let Some(open) = self.open.as_mut() else {
                self.reconnect.ready().await?;
                self.open = self.connect().await?;
                continue;
            };
            let read = tokio::time::timeout(self.idle_timeout, open.events.next()).await;
            match read {
                Ok(Some(Ok(event))) => {
                    open.pending.store(0, Ordering::Relaxed);
                    return Ok(self.received(event));
                }
                Ok(Some(Err(EventStreamError::Transport(Fault::TooLarge)))) => {
                    self.open = None;
                    let error = LoopError::protocol(&self.url, "an event over the size limit");
                    return Err(after_garbage(&mut self.reconnect, error));
                }
                Ok(Some(Err(EventStreamError::Utf8(_) | EventStreamError::Parser(_)))) => {
                    self.open = None;
                    let error = LoopError::protocol(&self.url, "a stream that is not SSE");
                    return Err(after_garbage(&mut self.reconnect, error));
                }
                Ok(None) => self.dropped("the stream ended", self.server_retry)?,
                Ok(Some(Err(EventStreamError::Transport(Fault::Transport(_))))) => {
                    self.dropped("the connection failed", None)?;
                }
                Err(_) => self.dropped("the stream was silent past the idle timeout", None)?,
            }
        }
    }

    fn received(&mut self, event: eventsource_stream::Event) -> SseEvent {
        self.reconnect.succeeded();
        if let Some(retry) = event.retry {
            self.server_retry = Some(retry);
        }
        if !event.id.is_empty() {
            self.last_event_id = Some(event.id.clone());
        }
        SseEvent {
            id: self.last_event_id.clone(),
            event: event.event,
            data: event.data,
        }
    }

    /// The stream is gone: reconnect after `at_least` or the backoff.
    fn dropped(&mut self, why: &str, at_least: Option<Duration>) -> Result<(), LoopError> {
        self.open = None;
        tracing::debug!(url = %self.url, why, "SSE stream dropped; reconnecting");
        self.reconnect
            .failed(at_least)
            .map_err(|gave_up| LoopError::GaveUp {
                failures: gave_up.failures,
                last: why.to_owned(),
            })
    }

    async fn connect(&mut self) -> Result<Option<OpenStream>, LoopError> {
        let mut request = self
            .client
            .inner()
            .get(self.url.clone())
            .header(header::ACCEPT, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache");
        if let Some(id) = &self.last_event_id {
            request = request.header("last-event-id", id);
        }
        let response = match self.client.send(request).await {
            Ok(response) => response,
            Err(error) => {
                after_call_failure(&mut self.reconnect, error)?;
                return Ok(None);
            }
        };
        if response.status() == StatusCode::NO_CONTENT {
            self.ended = true;
            return Err(LoopError::Ended);
        }
        let is_sse = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("text/event-stream"));
        if response.status() != StatusCode::OK || !is_sse {
            let error = LoopError::protocol(
                response.url(),
                format!("answered {} without text/event-stream", response.status()),
            );
            return Err(after_garbage(&mut self.reconnect, error));
        }
        Ok(Some(open_stream(response, self.event_limit)))
    }
}

/// The events of `response`, failing once `limit` bytes arrive without one.
fn open_stream(response: reqwest::Response, limit: usize) -> OpenStream {
    let pending = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&pending);
    let frames = futures_util::stream::unfold(Some(response), move |response| {
        let counted = Arc::clone(&counted);
        async move {
            let mut response = response?;
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if counted.fetch_add(chunk.len(), Ordering::Relaxed) + chunk.len() > limit {
                        return Some((Err(Fault::TooLarge), None));
                    }
                    Some((Ok(chunk), Some(response)))
                }
                Ok(None) => None,
                Err(error) => Some((Err(Fault::Transport(error)), None)),
            }
        }
    });
    OpenStream {
        events: (Box::pin(frames) as Frames).eventsource(),
        pending,
    }
}

impl SseClientBuilder {
    /// Resumes after this id (a saved [`SseClient::last_event_id`]), sent
    /// as `Last-Event-ID` on the first connection.
    #[must_use]
    pub fn last_event_id(mut self, id: impl Into<String>) -> Self {
        self.last_event_id = Some(id.into());
        self
    }

    /// How failures are ridden out (default [`Reconnect::new`]).
    #[must_use]
    pub fn reconnect(mut self, reconnect: Reconnect) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// How long the stream may stay silent before it is dropped (default
    /// [`DEFAULT_SSE_IDLE_TIMEOUT`]); keep it above the server's keepalive.
    #[must_use]
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// The most bytes one event may take (default
    /// [`DEFAULT_SSE_EVENT_LIMIT`]).
    #[must_use]
    pub fn event_limit(mut self, bytes: usize) -> Self {
        self.event_limit = bytes;
        self
    }

    /// The consumer.
    pub fn build(self) -> SseClient {
        SseClient {
            client: self.client.timeout(CONNECTION_LIFETIME),
            url: self.url,
            last_event_id: self.last_event_id,
            reconnect: self.reconnect.start(),
            idle_timeout: self.idle_timeout,
            event_limit: self.event_limit,
            server_retry: None,
            open: None,
            ended: false,
        }
    }
}
