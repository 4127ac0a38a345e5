//! Every limit and timer of the three transports, with its default and the
//! reason for it; invalid values are refused when the [`Realtime`] is built.
//!
//! [`Realtime`]: super::Realtime

use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::time::Duration;

use axum::http::{HeaderValue, Uri};

/// How long a long poll waits for an event before answering `204`: 25 s,
/// below every proxy's idle timeout (commonly 30 to 60 s), so the server,
/// not a proxy, ends the quiet request.
pub const DEFAULT_POLL_TIMEOUT: Duration = Duration::from_secs(25);
/// How often an idle SSE stream sends `: keepalive`: 15 s, comfortably
/// inside every idle timeout on the path (NATs, load balancers).
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(15);
/// The shortest `retry:` an SSE connection is told (reconnect delay).
pub const DEFAULT_RETRY_MIN: Duration = Duration::from_millis(2_000);
/// The longest `retry:` an SSE connection is told. Each connection gets its
/// own value in between, so a deploy does not bring everyone back at once.
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_millis(8_000);
/// How many bytes may wait for one client (SSE and WebSocket): 1 MiB. A
/// client that lets more pile up is not keeping up and is cut off; it
/// reconnects with its cursor and loses nothing.
pub const DEFAULT_MAX_BUFFERED: usize = 1 << 20;
/// How long a client catching up may take nothing from a full buffer
/// before it is cut off as stalled: 30 s.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How many events one read of the log returns at most.
pub const DEFAULT_READ_BATCH: usize = 100;
/// The WebSocket subprotocol clients must offer.
pub const DEFAULT_SUBPROTOCOL: &str = "keel.v1";
/// How often a WebSocket is pinged: 20 s. A connection whose pong has not
/// come back by the next ping is terminated, so a silently dropped
/// connection is noticed within 40 s.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(20);
/// The largest WebSocket message a client may send: 64 KiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 * 1024;
/// How long the application's `send` handler may take: 10 s.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a WebSocket close frame may take to go out before the
/// connection is dropped: 5 s.
pub const DEFAULT_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How many client message ids are remembered for deduplication, across
/// all connections: 100,000.
pub const DEFAULT_DEDUP_CAPACITY: usize = 100_000;
/// How long a client message id is remembered: 10 minutes, longer than
/// any sane reconnect-and-resend loop.
pub const DEFAULT_DEDUP_TTL: Duration = Duration::from_secs(600);
/// The longest cursor (`after`, `Last-Event-ID`) accepted: 20 characters,
/// enough for every non-negative `i64`.
pub const MAX_CURSOR_LEN: usize = 20;
/// The longest client message id accepted (WebSocket `send`), in bytes.
pub const MAX_CLIENT_ID_LEN: usize = 255;

/// A [`RealtimeOptions`] value was out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidRealtimeOptions {
    /// A duration that must be positive was zero.
    #[error("realtime option `{0}` must be greater than zero")]
    Zero(&'static str),
    /// The SSE retry range was empty.
    #[error("realtime option `retry`: the minimum ({min:?}) is above the maximum ({max:?})")]
    RetryRange {
        /// The minimum given.
        min: Duration,
        /// The maximum given.
        max: Duration,
    },
    /// An allowed origin was not `scheme://host[:port]`.
    #[error(
        "allowed origin {0:?} is not an origin: write `scheme://host[:port]`, e.g. \
         `https://shop.example`"
    )]
    Origin(String),
    /// The subprotocol was not a valid header token.
    #[error("subprotocol {0:?} is not a token: use letters, digits and `.-_`, e.g. `keel.v1`")]
    Subprotocol(String),
}

/// The limits and timers of long polling, SSE and WebSocket. Every
/// default is a constant of this module, documented with its reason.
#[derive(Debug, Clone)]
pub struct RealtimeOptions {
    pub(crate) poll_timeout: Duration,
    pub(crate) keepalive: Duration,
    pub(crate) retry_min: Duration,
    pub(crate) retry_max: Duration,
    pub(crate) max_buffered: usize,
    pub(crate) stall_timeout: Duration,
    pub(crate) read_batch: NonZeroUsize,
    pub(crate) allowed_origins: BTreeSet<String>,
    pub(crate) allow_missing_origin: bool,
    pub(crate) subprotocol: String,
    pub(crate) ping_interval: Duration,
    pub(crate) max_message_size: usize,
    pub(crate) send_timeout: Duration,
    pub(crate) close_timeout: Duration,
    pub(crate) dedup_capacity: NonZeroUsize,
    pub(crate) dedup_ttl: Duration,
    pub(crate) max_per_client: usize,
    pub(crate) max_total: usize,
    pub(crate) source: String,
    /// Origins as given, checked in `validate`.
    raw_origins: Vec<String>,
}

impl Default for RealtimeOptions {
    fn default() -> Self {
        Self {
            poll_timeout: DEFAULT_POLL_TIMEOUT,
            keepalive: DEFAULT_KEEPALIVE,
            retry_min: DEFAULT_RETRY_MIN,
            retry_max: DEFAULT_RETRY_MAX,
            max_buffered: DEFAULT_MAX_BUFFERED,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            read_batch: NonZeroUsize::new(DEFAULT_READ_BATCH).unwrap_or(NonZeroUsize::MIN),
            allowed_origins: BTreeSet::new(),
            allow_missing_origin: false,
            subprotocol: DEFAULT_SUBPROTOCOL.to_owned(),
            ping_interval: DEFAULT_PING_INTERVAL,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            close_timeout: DEFAULT_CLOSE_TIMEOUT,
            dedup_capacity: NonZeroUsize::new(DEFAULT_DEDUP_CAPACITY).unwrap_or(NonZeroUsize::MIN),
            dedup_ttl: DEFAULT_DEDUP_TTL,
            max_per_client: super::slots::DEFAULT_MAX_PER_CLIENT,
            max_total: super::slots::DEFAULT_MAX_TOTAL,
            source: super::cloudevents::DEFAULT_SOURCE.to_owned(),
            raw_origins: Vec::new(),
        }
    }
}

impl RealtimeOptions {
    /// The defaults. No WebSocket origin is allowed until you list one.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a long poll waits before `204` ([`DEFAULT_POLL_TIMEOUT`]).
    /// Keep it below the idle timeout of every proxy on the path.
    pub fn poll_timeout(mut self, timeout: Duration) -> Self {
        self.poll_timeout = timeout;
        self
    }

    /// The SSE keepalive interval ([`DEFAULT_KEEPALIVE`]).
    pub fn keepalive(mut self, every: Duration) -> Self {
        self.keepalive = every;
        self
    }

    /// The range each SSE connection's `retry:` is drawn from
    /// ([`DEFAULT_RETRY_MIN`] to [`DEFAULT_RETRY_MAX`]).
    pub fn retry(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// Bytes that may wait for one client before it is cut off
    /// ([`DEFAULT_MAX_BUFFERED`]). One event larger than this is still
    /// sent, alone.
    pub fn max_buffered(mut self, bytes: usize) -> Self {
        self.max_buffered = bytes;
        self
    }

    /// How long a catching-up client may leave a full buffer untouched
    /// ([`DEFAULT_STALL_TIMEOUT`]).
    pub fn stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// Events per read of the log ([`DEFAULT_READ_BATCH`]).
    pub fn read_batch(mut self, events: NonZeroUsize) -> Self {
        self.read_batch = events;
        self
    }

    /// The origins whose pages may open a WebSocket (`https://shop.example`);
    /// none by default. See the [`ws`](super::ws) docs on CSWSH.
    pub fn allowed_origins<I>(mut self, origins: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.raw_origins = origins.into_iter().map(Into::into).collect();
        self
    }

    /// Whether a WebSocket handshake without an `Origin` header is allowed
    /// (default `false`). Browsers always send one, so only non-browser
    /// clients (apps, services) lack it; allow it if you have those.
    pub fn allow_missing_origin(mut self, allow: bool) -> Self {
        self.allow_missing_origin = allow;
        self
    }

    /// The WebSocket subprotocol clients must offer ([`DEFAULT_SUBPROTOCOL`]).
    pub fn subprotocol(mut self, protocol: impl Into<String>) -> Self {
        self.subprotocol = protocol.into();
        self
    }

    /// The WebSocket ping interval ([`DEFAULT_PING_INTERVAL`]).
    pub fn ping_interval(mut self, every: Duration) -> Self {
        self.ping_interval = every;
        self
    }

    /// The largest message a WebSocket client may send
    /// ([`DEFAULT_MAX_MESSAGE_SIZE`]); a larger one closes with `1009`.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// How long the `send` handler may take ([`DEFAULT_SEND_TIMEOUT`]).
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// How long a close frame may take to go out ([`DEFAULT_CLOSE_TIMEOUT`]).
    pub fn close_timeout(mut self, timeout: Duration) -> Self {
        self.close_timeout = timeout;
        self
    }

    /// How many client message ids are remembered, and for how long
    /// ([`DEFAULT_DEDUP_CAPACITY`], [`DEFAULT_DEDUP_TTL`]).
    pub fn dedup(mut self, capacity: NonZeroUsize, ttl: Duration) -> Self {
        self.dedup_capacity = capacity;
        self.dedup_ttl = ttl;
        self
    }

    /// How many long-lived connections (SSE, WebSocket, waiting long polls)
    /// one client address may hold, and all clients together (defaults 16
    /// and 4,096). Past either, SSE and long polls get `503` with
    /// `Retry-After` and a WebSocket is closed with `1013` (try again later).
    pub fn max_connections(mut self, per_client: usize, total: usize) -> Self {
        self.max_per_client = per_client;
        self.max_total = total;
        self
    }

    /// The CloudEvents `source` of the log's events, for clients that read
    /// them as CloudEvents (default [`DEFAULT_SOURCE`](super::cloudevents::DEFAULT_SOURCE);
    /// see [`cloudevents`](super::cloudevents)).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Checks every value; normalises the origins.
    pub fn validate(mut self) -> Result<Self, InvalidRealtimeOptions> {
        for (name, value) in [
            ("poll_timeout", self.poll_timeout),
            ("keepalive", self.keepalive),
            ("stall_timeout", self.stall_timeout),
            ("ping_interval", self.ping_interval),
            ("send_timeout", self.send_timeout),
            ("close_timeout", self.close_timeout),
            ("dedup ttl", self.dedup_ttl),
        ] {
            if value.is_zero() {
                return Err(InvalidRealtimeOptions::Zero(name));
            }
        }
        if self.max_buffered == 0 {
            return Err(InvalidRealtimeOptions::Zero("max_buffered"));
        }
        if self.max_per_client == 0 || self.max_total == 0 {
            return Err(InvalidRealtimeOptions::Zero("max_connections"));
        }
        if self.max_message_size == 0 {
            return Err(InvalidRealtimeOptions::Zero("max_message_size"));
        }
        if self.retry_min > self.retry_max {
            return Err(InvalidRealtimeOptions::RetryRange {
                min: self.retry_min,
                max: self.retry_max,
            });
        }
        let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_');
        if self.subprotocol.is_empty() || !self.subprotocol.chars().all(token) {
            return Err(InvalidRealtimeOptions::Subprotocol(self.subprotocol));
        }
        for origin in std::mem::take(&mut self.raw_origins) {
            let normalised =
                normalise_origin(&origin).ok_or(InvalidRealtimeOptions::Origin(origin))?;
            self.allowed_origins.insert(normalised);
        }
        Ok(self)
    }
}

/// `scheme://host[:port]` in lower case, or `None` if `origin` is not one.
pub(crate) fn normalise_origin(origin: &str) -> Option<String> {
    let origin = origin.trim().trim_end_matches('/');
    let uri: Uri = origin.parse().ok()?;
    let scheme = uri.scheme_str()?;
    let authority = uri.authority()?;
    let bare = uri.path().is_empty() || uri.path() == "/";
    if !bare || uri.query().is_some() || authority.as_str().contains('@') {
        return None;
    }
    Some(format!("{scheme}://{authority}").to_ascii_lowercase())
}

/// The `Origin` header as a normalised origin (`None` when it is not one).
pub(crate) fn origin_of(header: &HeaderValue) -> Option<String> {
    normalise_origin(header.to_str().ok()?)
}
