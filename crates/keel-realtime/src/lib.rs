//! Real-time push over one resumable per-user event log: long polling, SSE
//! and WebSocket read the same log, with the same cursor.
//!
//! # Why one log
//!
//! A push that goes straight from the code that made an event to the open
//! connections loses everything sent while a client was away (a train
//! tunnel, a deploy, a laptop lid), and cannot tell the client what it
//! missed. Here every event is first appended to its user's stream in the
//! business transaction ([`EventLog::append`], with a seq per stream), and
//! all three transports only ever *read the log after a cursor*. A
//! reconnecting client says where it was (`after`, `Last-Event-ID`,
//! `resume`) and gets exactly what followed: no gap, no duplicate. An
//! in-process [`Notifier`] wakes waiting connections after each commit; it
//! carries only seqs, so it can lose or merge wake-ups without losing
//! events, and a multi-node backplane can replace it later.
//!
//! - [`long_poll`]: `GET ?after=` → `200 {events, cursor}`, or `204` after
//!   25 s;
//! - [`sse`]: `text/event-stream` with `id`/`event`/`retry`/`data`, 15 s
//!   keepalives, `Last-Event-ID` resume, slow clients cut off at 1 MiB;
//! - [`ws`]: Origin allow-list and auth at the handshake, subprotocol
//!   `keel.v1`, acked and deduplicated client messages, resume, heartbeats,
//!   `1013` when a client falls behind.
//!
//! Authentication is the application's: it says which stream a request may
//! read through [`Authenticate`] (any `Fn(&Parts) -> Option<StreamId>`).
//! Retention ([`Retention`], [`EventLog::run_retention`]) keeps the log
//! bounded; a client whose cursor fell behind it is told
//! (`keel.truncated`, or `"truncated": true`).
//!
//! # Drain
//!
//! axum's graceful shutdown waits for open requests, and these requests
//! never end by themselves. Pass the drain signal to
//! [`RealtimeBuilder::drain`]: a `tokio::sync::watch::Receiver<bool>` that
//! turns `true` when the process starts draining (the health module's drain
//! helper, or your SIGTERM handler, holds the sender). Then waiting long
//! polls answer `204`, SSE streams end cleanly, WebSockets close with
//! `1001`, and new requests are refused with `503` (SSE: an immediate clean
//! end, which `EventSource` retries), so the server's graceful shutdown can
//! finish within its drain timeout.
//!
//! ```
//! use axum::Router;
//! use axum::http::request::Parts;
//! use keel_realtime::{EventLog, Realtime, RealtimeOptions, StreamId};
//! use keel_sqlite::SqliteStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = SqliteStore::open_in_memory().await?;
//! let log = EventLog::new(store);
//! let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
//!
//! // Your auth middleware put the user id into the extensions.
//! #[derive(Clone)]
//! struct UserId(String);
//! let authenticate = |parts: &Parts| {
//!     let user = parts.extensions.get::<UserId>()?;
//!     StreamId::new(format!("user:{}", user.0)).ok()
//! };
//!
//! let realtime = Realtime::builder(log.clone(), authenticate)
//!     .options(RealtimeOptions::new().allowed_origins(["https://shop.example"]))
//!     .drain(drain_rx)
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/updates", realtime.long_poll())
//!     .route("/stream", realtime.sse())
//!     .route("/ws", realtime.websocket());
//!
//! // Elsewhere, in the business transaction:
//! log.publish(&StreamId::new("user:42")?, "order.shipped", &serde_json::json!({"orderId": "A-4471"}))
//!     .await?;
//! // On SIGTERM, after readiness failed:
//! drain_tx.send_replace(true);
//! # let _ = app;
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod cloudevents;
pub mod feed;
mod log;
pub mod long_poll;
mod notifier;
mod options;
mod queue;
mod reject;
mod retention;
mod slots;
pub mod sse;
mod stream;
pub mod ws;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::http::request::Parts;
use axum::routing::{MethodRouter, any, get};
use keel_store::EventLogStore;
use tokio::sync::watch;

pub use feed::TRUNCATED_EVENT;
pub use log::{AppendError, Appended, EventLog, MAX_EVENT_TYPE_LEN};
pub use notifier::{LocalNotifier, Notifier, Subscription};
pub use options::*;
pub use reject::RealtimeRejection;
pub use retention::{
    DEFAULT_KEEP_LAST, DEFAULT_MAX_AGE, DEFAULT_TRIM_BATCH, DEFAULT_TRIM_INTERVAL, Retention,
};
pub use slots::{DEFAULT_MAX_PER_CLIENT, DEFAULT_MAX_TOTAL};
pub use stream::{Authenticate, InvalidStreamId, MAX_STREAM_ID_LEN, StreamId};
pub use ws::{OnSend, SendMessage, SendRejected};

/// The three real-time endpoints over one [`EventLog`]. Cheap to clone.
#[derive(Debug)]
pub struct Realtime<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Realtime<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

struct Shared<S> {
    log: EventLog<S>,
    authenticate: Box<dyn Authenticate>,
    options: RealtimeOptions,
    drain: watch::Receiver<bool>,
    on_send: Option<Arc<dyn OnSend>>,
    acks: ws::Acks,
    stats: Arc<Stats>,
    slots: slots::ClientSlots,
}

impl<S> std::fmt::Debug for Shared<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Realtime")
            .field("options", &self.options)
            .field("draining", &*self.drain.borrow())
            .finish_non_exhaustive()
    }
}

/// Builds a [`Realtime`]; see [`Realtime::builder`].
pub struct RealtimeBuilder<S> {
    log: EventLog<S>,
    authenticate: Box<dyn Authenticate>,
    options: RealtimeOptions,
    drain: Option<watch::Receiver<bool>>,
    on_send: Option<Arc<dyn OnSend>>,
}

impl<S> std::fmt::Debug for RealtimeBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealtimeBuilder")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: EventLogStore> RealtimeBuilder<S> {
    /// Limits and timers (defaults: [`RealtimeOptions::new`]).
    pub fn options(mut self, options: RealtimeOptions) -> Self {
        self.options = options;
        self
    }

    /// The drain signal: when it turns `true`, open connections end cleanly
    /// and new ones are refused (see the module docs). Without it, they end
    /// only when their clients leave.
    pub fn drain(mut self, drain: watch::Receiver<bool>) -> Self {
        self.drain = Some(drain);
        self
    }

    /// What to do with WebSocket clients' `send` messages (without it they
    /// are refused with a `nack`).
    pub fn on_send(mut self, handler: impl OnSend) -> Self {
        self.on_send = Some(Arc::new(handler));
        self
    }

    /// Checks the options and builds.
    pub fn build(self) -> Result<Realtime<S>, InvalidRealtimeOptions> {
        let options = self.options.validate()?;
        let drain = self.drain.unwrap_or_else(|| watch::channel(false).1);
        let acks = ws::Acks::new(options.dedup_capacity, options.dedup_ttl);
        let slots = slots::ClientSlots::new(options.max_per_client, options.max_total);
        Ok(Realtime {
            shared: Arc::new(Shared {
                log: self.log,
                authenticate: self.authenticate,
                options,
                drain,
                on_send: self.on_send,
                acks,
                stats: Arc::new(Stats::default()),
                slots,
            }),
        })
    }
}

impl<S: EventLogStore> Realtime<S> {
    /// A builder: the log to serve, and who may read which stream.
    pub fn builder(log: EventLog<S>, authenticate: impl Authenticate) -> RealtimeBuilder<S> {
        RealtimeBuilder {
            log,
            authenticate: Box::new(authenticate),
            options: RealtimeOptions::new(),
            drain: None,
            on_send: None,
        }
    }

    /// The log.
    pub fn log(&self) -> &EventLog<S> {
        &self.shared.log
    }

    /// The options in force.
    pub fn options(&self) -> &RealtimeOptions {
        &self.shared.options
    }

    /// Counters and gauges of the endpoints (the same as the metrics).
    pub fn stats(&self) -> RealtimeStats {
        self.shared.stats.snapshot()
    }

    /// The long-poll endpoint, for `Router::route("/updates", ...)`.
    pub fn long_poll<T>(&self) -> MethodRouter<T>
    where
        T: Clone + Send + Sync + 'static,
    {
        get(long_poll::handler::<S>).with_state(self.clone())
    }

    /// The SSE endpoint, for `Router::route("/stream", ...)`.
    pub fn sse<T>(&self) -> MethodRouter<T>
    where
        T: Clone + Send + Sync + 'static,
    {
        get(sse::handler::<S>).with_state(self.clone())
    }

    /// The WebSocket endpoint, for `Router::route("/ws", ...)`. It accepts
    /// any method so HTTP/2 extended CONNECT works as well as HTTP/1.1 GET.
    pub fn websocket<T>(&self) -> MethodRouter<T>
    where
        T: Clone + Send + Sync + 'static,
    {
        any(ws::handler::<S>).with_state(self.clone())
    }

    /// All three at `/updates`, `/stream` and `/ws`.
    pub fn router<T>(&self) -> Router<T>
    where
        T: Clone + Send + Sync + 'static,
    {
        Router::new()
            .route("/updates", self.long_poll())
            .route("/stream", self.sse())
            .route("/ws", self.websocket())
    }

    pub(crate) fn authenticate(&self, parts: &Parts) -> Option<StreamId> {
        self.shared.authenticate.authenticate(parts)
    }

    pub(crate) fn is_draining(&self) -> bool {
        *self.shared.drain.borrow()
    }

    pub(crate) fn drain_signal(&self) -> watch::Receiver<bool> {
        self.shared.drain.clone()
    }

    pub(crate) fn on_send(&self) -> Option<&Arc<dyn OnSend>> {
        self.shared.on_send.as_ref()
    }

    /// A slot for the request's client, or `None` past the caps.
    pub(crate) fn claim_slot(&self, parts: &Parts) -> Option<slots::ClientSlot> {
        let client = keel_http::access::client_ip(&parts.extensions);
        let slot = self.shared.slots.claim(client);
        if slot.is_none() {
            tracing::warn!(
                ?client,
                "long-lived connection refused: the client holds the most allowed"
            );
        }
        slot
    }

    pub(crate) fn acks(&self) -> &ws::Acks {
        &self.shared.acks
    }

    /// This connection's `retry:` in milliseconds, uniformly in the range.
    pub(crate) fn jittered_retry_ms(&self) -> u64 {
        let options = &self.shared.options;
        let min = u64::try_from(options.retry_min.as_millis()).unwrap_or(u64::MAX);
        let max = u64::try_from(options.retry_max.as_millis()).unwrap_or(u64::MAX);
        fastrand::u64(min..=max.max(min))
    }

    pub(crate) fn open(&self, gauge: Gauge) -> Open {
        Open::new(Arc::clone(&self.shared.stats), gauge)
    }

    pub(crate) fn count_slow_client(&self, transport: &str) {
        let stats = &self.shared.stats;
        let counter = if transport == "sse" {
            &stats.sse_slow
        } else {
            &stats.ws_slow
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_heartbeat_timeout(&self) {
        self.shared
            .stats
            .ws_heartbeat
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_duplicate(&self) {
        self.shared
            .stats
            .ws_duplicates
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Waits until `drain` is `true`; forever if its sender is gone.
pub(crate) async fn wait_drain(drain: &mut watch::Receiver<bool>) {
    if drain.wait_for(|draining| *draining).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A snapshot of the endpoints' counters and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RealtimeStats {
    /// Open SSE streams.
    pub sse_connections: u64,
    /// Open WebSockets.
    pub websocket_connections: u64,
    /// Long polls waiting for an event.
    pub long_polls_waiting: u64,
    /// SSE clients cut off as too slow, since start.
    pub sse_slow_clients: u64,
    /// WebSockets closed with `1013`, since start.
    pub websocket_slow_clients: u64,
    /// WebSockets terminated for a missed pong, since start.
    pub websocket_heartbeat_timeouts: u64,
    /// Duplicate client messages acked without being handled, since start.
    pub websocket_duplicates: u64,
}

#[derive(Debug, Default)]
struct Stats {
    sse_open: AtomicU64,
    ws_open: AtomicU64,
    polls_waiting: AtomicU64,
    sse_slow: AtomicU64,
    ws_slow: AtomicU64,
    ws_heartbeat: AtomicU64,
    ws_duplicates: AtomicU64,
}

impl Stats {
    fn snapshot(&self) -> RealtimeStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        RealtimeStats {
            sse_connections: get(&self.sse_open),
            websocket_connections: get(&self.ws_open),
            long_polls_waiting: get(&self.polls_waiting),
            sse_slow_clients: get(&self.sse_slow),
            websocket_slow_clients: get(&self.ws_slow),
            websocket_heartbeat_timeouts: get(&self.ws_heartbeat),
            websocket_duplicates: get(&self.ws_duplicates),
        }
    }
}

/// Which gauge an [`Open`] guard holds up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gauge {
    Sse,
    WebSocket,
    LongPollWaiting,
}

impl Gauge {
    fn parts(self, stats: &Stats) -> (&AtomicU64, &'static str) {
        match self {
            Self::Sse => (&stats.sse_open, "sse"),
            Self::WebSocket => (&stats.ws_open, "websocket"),
            Self::LongPollWaiting => (&stats.polls_waiting, "long_poll"),
        }
    }
}

/// Counts a connection (or a waiting long poll) while it lives.
#[derive(Debug)]
pub(crate) struct Open {
    stats: Arc<Stats>,
    gauge: Gauge,
}

impl Open {
    fn new(stats: Arc<Stats>, gauge: Gauge) -> Self {
        let (counter, transport) = gauge.parts(&stats);
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!("keel_realtime_connections", "transport" => transport).increment(1.0);
        Self { stats, gauge }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let (counter, transport) = self.gauge.parts(&self.stats);
        counter.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("keel_realtime_connections", "transport" => transport).decrement(1.0);
    }
}
