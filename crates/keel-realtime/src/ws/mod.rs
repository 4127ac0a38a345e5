//! WebSocket: pushes the stream's events, takes the client's messages with
//! acks and deduplication, resumes after a seq; subprotocol `keel.v1`
//! (messages in [`protocol`]).
//!
//! # The handshake is the only HTTP moment: check Origin and auth there
//!
//! Browsers send cookies on a cross-site WebSocket handshake, and CORS does
//! not apply to WebSockets, so a page on `evil.example` can open a socket to
//! your API *as your logged-in user* and read everything it pushes:
//! cross-site WebSocket hijacking (CSWSH). The defence is the `Origin`
//! header, which a browser always sets and a page cannot forge: the
//! handshake is refused with `403` unless the origin is on the allow-list
//! ([`RealtimeOptions::allowed_origins`](super::RealtimeOptions::allowed_origins)).
//! Refusing the upgrade itself (rather than accepting and closing) means no
//! socket ever exists for a foreign page. A missing `Origin` (non-browser
//! clients) is refused too unless allowed.
//!
//! Authentication comes next (after the origin check, since cookies are the
//! very thing a hijacking page rides on). An unauthenticated client gets the
//! upgrade and then an immediate close `1008` (policy violation): a browser
//! script never sees a refused handshake's status, only close codes, and
//! `1008` tells it "sign in, do not retry". The handshake must also offer
//! the subprotocol (`keel.v1`), or it is refused with `400`; a breaking
//! protocol change gets a new name, and old clients fail loudly.
//!
//! # After the handshake
//!
//! - **cursor**: `?after=<seq>` replays after it; without it the socket
//!   starts live from the stream's current end; `{"type":"resume","after"}`
//!   replays at any time (subscribe-before-replay as in [`feed`](super::feed));
//! - **acks**: each `send` is acked by its client id after the application's
//!   [`OnSend`] handled it; the same id again (a resend after a reconnect)
//!   is acked without being handled twice. The window of handled ids is
//!   shared by all connections (a resend comes on the *next* connection),
//!   remembers an id only once it was handled successfully (a resend while
//!   the first attempt runs is told to retry), and is bounded in time and
//!   count, so it is best-effort: make the effect idempotent on the id too;
//! - **heartbeats**: a ping every 20 s; a connection whose pong has not come
//!   back by the next ping is terminated (a NAT or load balancer dropped it
//!   silently);
//! - **falling behind**: outgoing messages wait in a queue bounded in bytes
//!   (1 MiB); a client that lets live events overflow it, or that takes
//!   nothing for the stall timeout while catching up, is closed with `1013`
//!   (try again later): it reconnects and resumes, losing nothing;
//! - **drain**: when the drain signal turns `true`, every socket is closed
//!   with `1001` (going away) after the messages already queued.

mod acks;
mod connection;
pub mod protocol;

use async_trait::async_trait;
use axum::extract::ws::{CloseFrame, Message, WebSocketUpgrade, close_code};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use keel_store::EventLogStore;
use serde_json::{Map, Value};

pub(crate) use acks::Acks;

use super::Realtime;
use super::options::origin_of;
use super::reject::{RealtimeRejection, after_param, refuse};
use super::stream::StreamId;
use keel_http::problem::Problem;

const TRANSPORT: &str = "websocket";

/// Initial capacity of a socket's read buffer: small, so an idle socket
/// costs little (tungstenite's default is 128 KiB); it grows for larger
/// messages up to the message size limit.
const READ_BUFFER: usize = 4 * 1024;

/// A client's `{"type": "send"}` message.
#[derive(Debug, Clone, PartialEq)]
pub struct SendMessage {
    /// The client's id for the message; a resend carries the same id.
    pub id: String,
    /// The other fields of the message.
    pub body: Map<String, Value>,
}

/// The application refused or could not handle a client's message; the
/// client gets a `nack` saying whether to resend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendRejected {
    /// The message is wrong and will stay wrong: do not resend it.
    #[error("{0}")]
    Invalid(String),
    /// Handling failed for now (a dependency is down): resend it later
    /// with the same id.
    #[error("{0}")]
    Unavailable(String),
}

/// What the application does with a client's `send` message (validate,
/// authorise, write): the same rules as any write API. Dedupe on
/// `message.id` in your own store too if the effect must never repeat (the
/// in-memory window is best-effort).
///
/// Any `Fn(StreamId, SendMessage) -> impl Future<Output = Result<(), SendRejected>>`
/// is one.
#[async_trait]
pub trait OnSend: Send + Sync + 'static {
    /// Handles one message of the client reading `stream`.
    async fn on_send(&self, stream: &StreamId, message: SendMessage) -> Result<(), SendRejected>;
}

#[async_trait]
impl<F, Fut> OnSend for F
where
    F: Fn(StreamId, SendMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), SendRejected>> + Send + 'static,
{
    async fn on_send(&self, stream: &StreamId, message: SendMessage) -> Result<(), SendRejected> {
        self(stream.clone(), message).await
    }
}

/// The WebSocket handler (see the module docs for the order of checks).
pub(crate) async fn handler<S: EventLogStore>(
    State(realtime): State<Realtime<S>>,
    request: Request,
) -> Response {
    let (mut parts, _body) = request.into_parts();
    if realtime.is_draining() {
        return refuse(TRANSPORT, RealtimeRejection::Draining);
    }
    let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
        Ok(upgrade) => upgrade,
        Err(rejection) => {
            metrics::counter!("keel_realtime_rejected_total", "transport" => TRANSPORT,
                "reason" => "handshake")
            .increment(1);
            return Problem::new(rejection.status(), rejection.body_text()).into_response();
        }
    };
    let options = realtime.options();
    let origin_allowed = match parts.headers.get(header::ORIGIN) {
        None => options.allow_missing_origin,
        Some(origin) => origin_of(origin).is_some_and(|o| options.allowed_origins.contains(&o)),
    };
    if !origin_allowed {
        tracing::warn!(origin = ?parts.headers.get(header::ORIGIN),
            "WebSocket handshake from an origin not on the allow-list refused");
        return refuse(TRANSPORT, RealtimeRejection::OriginNotAllowed);
    }
    let subprotocol = options.subprotocol.clone();
    if !upgrade
        .requested_protocols()
        .any(|p| p.as_bytes() == subprotocol.as_bytes())
    {
        return refuse(TRANSPORT, RealtimeRejection::Subprotocol(subprotocol));
    }
    let after = match after_param(&parts) {
        Ok(after) => after,
        Err(rejection) => return refuse(TRANSPORT, rejection),
    };
    let upgrade = upgrade
        .protocols([subprotocol])
        .read_buffer_size(READ_BUFFER)
        .write_buffer_size(0)
        .max_message_size(options.max_message_size)
        .max_frame_size(options.max_message_size)
        .on_failed_upgrade(|err| tracing::debug!(error = %err, "WebSocket upgrade failed"));
    let Some(stream) = realtime.authenticate(&parts) else {
        metrics::counter!("keel_realtime_rejected_total", "transport" => TRANSPORT,
            "reason" => "unauthenticated")
        .increment(1);
        return upgrade.on_upgrade(|mut socket| async move {
            let close = CloseFrame {
                code: close_code::POLICY,
                reason: "authentication required".into(),
            };
            let _ = socket.send(Message::Close(Some(close))).await;
        });
    };
    let Some(slot) = realtime.claim_slot(&parts) else {
        metrics::counter!("keel_realtime_rejected_total", "transport" => TRANSPORT,
            "reason" => "connections")
        .increment(1);
        // A browser cannot read a refused handshake's status; it can read
        // a close code.
        return upgrade.on_upgrade(|mut socket| async move {
            let close = CloseFrame {
                code: close_code::AGAIN,
                reason: "too many open connections from this client; retry later".into(),
            };
            let _ = socket.send(Message::Close(Some(close))).await;
        });
    };
    upgrade.on_upgrade(move |socket| async move {
        let _slot = slot;
        connection::run(realtime, socket, stream, after).await;
    })
}
