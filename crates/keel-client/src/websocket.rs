//! [`KeelSocket`]: the client half of Keel's WebSocket protocol, `keel.v1`
//! (on tokio-tungstenite).
//!
//! - **resume**: the client remembers the highest event `seq` it returned
//!   and reconnects with `?after=<seq>`, so the server replays exactly what
//!   it missed; an event at or below that seq (a replay overlapping the
//!   live push) is dropped, never returned twice;
//! - **acked sends**: [`send`](KeelSocket::send) gives each message an id
//!   and keeps it until the server acks it; after a reconnect every
//!   unacknowledged message is sent again with the same id (the server
//!   acks a duplicate without handling it twice). A retryable `nack` is
//!   resent after a second; a final one is returned to the caller. At most
//!   1,024 messages wait for acks ([`LoopError::Backlog`] beyond);
//! - **heartbeats**: a ping every 20 s; a connection whose pong has not come
//!   back by the next ping is dropped and reconnected (a NAT or balancer
//!   forgot it);
//! - **jittered reconnect** ([`Reconnect`]) after a drop, a `1001` (server
//!   draining) or a `1013` (client fell behind), and **no reconnect after
//!   `1008`** (policy violation: not signed in): [`LoopError::PolicyViolation`]
//!   for this call and every later one.
//!
//! The socket is driven by [`next`](KeelSocket::next): keep calling it
//! (it reconnects, resends and pings inside), and call
//! [`send`](KeelSocket::send) between calls.
//!
//! Without [`after`](KeelSocketBuilder::after) the first connection starts
//! live, at the stream's end, and so does every reconnect until the first
//! event arrives; pass `after(0)` (or a saved seq) when nothing may be
//! missed.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http::{HeaderName, HeaderValue};
use serde_json::{Map, Value};
use tokio::net::TcpStream;
use tokio::time::{Instant, sleep_until};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::loop_error::{after_call_failure, after_garbage};
use crate::reconnect::ReconnectState;
use crate::{HttpCallError, LoopError, Reconnect};

/// The subprotocol: `keel.v1`.
pub const KEEL_SUBPROTOCOL: &str = "keel.v1";

/// How often the client pings: 20 s.
pub const DEFAULT_WS_HEARTBEAT: Duration = Duration::from_secs(20);

/// How many sent messages may wait for their ack: 1,024.
pub const DEFAULT_WS_MAX_UNACKED: usize = 1024;

/// How long a handshake may take: 10 s.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after a retryable `nack` the message is sent again: 1 s.
const RESEND_AFTER_NACK: Duration = Duration::from_secs(1);

/// What [`KeelSocket::next`] returns.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SocketMessage {
    /// An event of the stream, in seq order, each once.
    Event {
        /// Its position in the stream.
        seq: i64,
        /// Its type.
        event_type: String,
        /// Its payload.
        data: Value,
    },
    /// The server handled the message with this id (maybe before).
    Acked {
        /// The id [`send`](KeelSocket::send) returned.
        id: String,
    },
    /// The server refused the message with this id for good; it is not
    /// sent again.
    Refused {
        /// The id [`send`](KeelSocket::send) returned.
        id: String,
        /// Why.
        detail: String,
    },
    /// Retention removed the events after `after` and before `next` before
    /// this client read them: reload the application's state.
    Truncated {
        /// The client's cursor.
        after: i64,
        /// The oldest seq left.
        next: i64,
    },
    /// The server could not read a message the client sent.
    ServerError {
        /// What it said.
        detail: String,
    },
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

struct Outgoing {
    id: String,
    text: String,
    sent: bool,
}

/// A `keel.v1` WebSocket client that reconnects, resumes and resends.
/// Build it with [`KeelSocket::builder`].
///
/// ```no_run
/// use keel_client::{KeelSocket, SocketMessage};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut socket = KeelSocket::builder("ws://127.0.0.1:8080/ws".parse()?)
///     .origin("https://shop.example")
///     .header("authorization", "Bearer …")
///     .after(0)
///     .build()?;
/// socket.send(serde_json::json!({"text": "hello"}).as_object().cloned().unwrap_or_default()).await?;
/// loop {
///     match socket.next().await? {
///         SocketMessage::Event { seq, event_type, .. } => println!("{seq} {event_type}"),
///         SocketMessage::Acked { id } => println!("{id} handled"),
///         other => println!("{other:?}"),
///     }
/// }
/// # }
/// ```
pub struct KeelSocket {
    url: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
    last_seq: Option<i64>,
    outbox: VecDeque<Outgoing>,
    max_unacked: usize,
    socket: Option<Socket>,
    reconnect: ReconnectState,
    heartbeat: Duration,
    next_ping: Instant,
    awaiting_pong: bool,
    resend_at: Option<Instant>,
    policy_closed: Option<String>,
    connections: u64,
}

impl std::fmt::Debug for KeelSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeelSocket")
            .field("url", &self.url.as_str())
            .field("last_seq", &self.last_seq)
            .field("unacked", &self.outbox.len())
            .field("connected", &self.socket.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures a [`KeelSocket`].
#[derive(Debug)]
pub struct KeelSocketBuilder {
    url: reqwest::Url,
    headers: Vec<(String, String)>,
    after: Option<i64>,
    reconnect: Reconnect,
    heartbeat: Duration,
    max_unacked: usize,
}

/// What woke [`KeelSocket::next`].
enum Wake {
    Read(Option<Result<Message, tungstenite::Error>>),
    Ping,
    Resend,
}

impl KeelSocket {
    /// A socket to `url` (`ws://` or `wss://`).
    pub fn builder(url: reqwest::Url) -> KeelSocketBuilder {
        KeelSocketBuilder {
            url,
            headers: Vec::new(),
            after: None,
            reconnect: Reconnect::new(),
            heartbeat: DEFAULT_WS_HEARTBEAT,
            max_unacked: DEFAULT_WS_MAX_UNACKED,
        }
    }

    /// The highest event seq returned so far: where a reconnect resumes.
    pub fn last_seq(&self) -> Option<i64> {
        self.last_seq
    }

    /// How many sent messages wait for their ack.
    pub fn unacked(&self) -> usize {
        self.outbox.len()
    }

    /// How many handshakes succeeded so far.
    pub fn connections(&self) -> u64 {
        self.connections
    }

    /// Queues `body` as a `send` with a fresh id, writes it now when
    /// connected, and returns the id its ack will carry.
    ///
    /// # Errors
    ///
    /// [`LoopError::Backlog`] when too many messages wait for acks;
    /// [`LoopError::PolicyViolation`] after a `1008`.
    pub async fn send(&mut self, body: Map<String, Value>) -> Result<String, LoopError> {
        self.send_with_id(keel_core::id::new_id().to_string(), body)
            .await
    }

    /// As [`send`](Self::send), with the application's own id (a resend
    /// after the client itself restarted uses the same id).
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub async fn send_with_id(
        &mut self,
        id: String,
        mut body: Map<String, Value>,
    ) -> Result<String, LoopError> {
        self.check_open()?;
        if self.outbox.len() >= self.max_unacked {
            return Err(LoopError::Backlog {
                limit: self.max_unacked,
            });
        }
        body.insert("type".into(), Value::from("send"));
        body.insert("id".into(), Value::from(id.clone()));
        let text = Value::Object(body).to_string();
        self.outbox.push_back(Outgoing {
            id: id.clone(),
            text,
            sent: false,
        });
        self.flush().await;
        Ok(id)
    }

    /// The next message, reconnecting, resending and pinging as needed.
    /// Cancel-safe: a dropped call loses no event and no send.
    ///
    /// # Errors
    ///
    /// See [`LoopError`]: the deadline, a refused handshake, a server that
    /// does not speak `keel.v1`, a `1008`, or too many failures in a row.
    pub async fn next(&mut self) -> Result<SocketMessage, LoopError> {
        loop {
            self.check_open()?;
            let Some(socket) = self.socket.as_mut() else {
                self.reconnect.ready().await?;
                self.connect().await?;
                continue;
            };
            let wake = tokio::select! {
                read = socket.next() => Wake::Read(read),
                () = sleep_until(self.next_ping) => Wake::Ping,
                () = sleep_until(self.resend_at.unwrap_or(self.next_ping)), if self.resend_at.is_some() => Wake::Resend,
            };
            match wake {
                Wake::Read(Some(Ok(message))) => {
                    if let Some(message) = self.on_message(message)? {
                        return Ok(message);
                    }
                }
                Wake::Read(Some(Err(_)) | None) => self.dropped("the connection failed")?,
                Wake::Ping => self.heartbeat().await?,
                Wake::Resend => {
                    self.resend_at = None;
                    self.flush().await;
                }
            }
        }
    }

    /// Closes the connection with `1000`; unacked messages stay queued for
    /// a later [`next`](Self::next), which reconnects.
    pub async fn close(&mut self) {
        if let Some(mut socket) = self.socket.take() {
            let _ = socket.close(None).await;
        }
    }

    fn check_open(&self) -> Result<(), LoopError> {
        match &self.policy_closed {
            Some(reason) => Err(LoopError::PolicyViolation {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn on_message(&mut self, message: Message) -> Result<Option<SocketMessage>, LoopError> {
        match message {
            Message::Text(text) => self.on_text(text.as_str()),
            Message::Pong(_) => {
                self.awaiting_pong = false;
                Ok(None)
            }
            Message::Close(frame) => {
                let (code, reason) = frame.map_or((CloseCode::Status, String::new()), |f| {
                    (f.code, f.reason.as_str().to_owned())
                });
                if code == CloseCode::Policy {
                    self.socket = None;
                    self.policy_closed = Some(reason);
                    self.check_open()?;
                }
                self.dropped("the server closed the socket")?;
                Ok(None)
            }
            Message::Ping(_) | Message::Binary(_) | Message::Frame(_) => Ok(None),
        }
    }

    fn on_text(&mut self, text: &str) -> Result<Option<SocketMessage>, LoopError> {
        let Ok(Value::Object(message)) = serde_json::from_str::<Value>(text) else {
            self.socket = None;
            let error = LoopError::protocol(&self.url, "a text frame that is not a JSON object");
            return Err(after_garbage(&mut self.reconnect, error));
        };
        let text_of = |key: &str| {
            message
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let kind = text_of("type");
        if let Some(seq) = message.get("seq").and_then(Value::as_i64) {
            self.reconnect.succeeded();
            if self.last_seq.is_some_and(|last| seq <= last) {
                return Ok(None);
            }
            self.last_seq = Some(seq);
            let data = message.get("data").cloned().unwrap_or(Value::Null);
            return Ok(Some(SocketMessage::Event {
                seq,
                event_type: kind,
                data,
            }));
        }
        let id = text_of("id");
        let number = |key: &str| message.get(key).and_then(Value::as_i64).unwrap_or_default();
        Ok(match kind.as_str() {
            "ack" => {
                self.reconnect.succeeded();
                self.outbox.retain(|outgoing| outgoing.id != id);
                Some(SocketMessage::Acked { id })
            }
            "nack" if message.get("retryable") == Some(&Value::Bool(true)) => {
                self.outbox
                    .iter_mut()
                    .filter(|outgoing| outgoing.id == id)
                    .for_each(|outgoing| outgoing.sent = false);
                self.resend_at = Some(Instant::now() + RESEND_AFTER_NACK);
                None
            }
            "nack" => {
                self.outbox.retain(|outgoing| outgoing.id != id);
                Some(SocketMessage::Refused {
                    id,
                    detail: text_of("detail"),
                })
            }
            "keel.truncated" => Some(SocketMessage::Truncated {
                after: number("after"),
                next: number("next"),
            }),
            "error" => Some(SocketMessage::ServerError {
                detail: text_of("detail"),
            }),
            other => {
                tracing::debug!(kind = other, "ignoring an unknown keel.v1 control message");
                None
            }
        })
    }

    async fn heartbeat(&mut self) -> Result<(), LoopError> {
        if self.awaiting_pong {
            return self.dropped("no pong since the last ping");
        }
        self.next_ping = Instant::now() + self.heartbeat;
        self.awaiting_pong = true;
        if let Some(socket) = self.socket.as_mut()
            && socket
                .send(Message::Ping(Default::default()))
                .await
                .is_err()
        {
            return self.dropped("the ping could not be sent");
        }
        Ok(())
    }

    /// Writes every queued message not yet sent on this connection.
    async fn flush(&mut self) {
        let Some(socket) = self.socket.as_mut() else {
            return;
        };
        let mut failed = false;
        for outgoing in self.outbox.iter_mut().filter(|o| !o.sent) {
            if socket
                .feed(Message::text(outgoing.text.clone()))
                .await
                .is_err()
            {
                failed = true;
                break;
            }
            outgoing.sent = true;
        }
        if failed || socket.flush().await.is_err() {
            // `next` notices the broken socket and reconnects.
            self.outbox.iter_mut().for_each(|o| o.sent = false);
        }
    }

    /// The connection is gone: reconnect after the backoff.
    fn dropped(&mut self, why: &str) -> Result<(), LoopError> {
        self.socket = None;
        tracing::debug!(url = %self.url, why, "WebSocket dropped; reconnecting");
        self.reconnect
            .failed(None)
            .map_err(|gave_up| LoopError::GaveUp {
                failures: gave_up.failures,
                last: why.to_owned(),
            })
    }

    async fn connect(&mut self) -> Result<(), LoopError> {
        let request = self.handshake()?;
        let limit = keel_core::Deadline::current_remaining()
            .map_or(CONNECT_TIMEOUT, |left| left.min(CONNECT_TIMEOUT));
        let connected =
            tokio::time::timeout(limit, tokio_tungstenite::connect_async(request)).await;
        match connected {
            Ok(Ok((socket, _response))) => {
                self.socket = Some(socket);
                self.connections += 1;
                self.next_ping = Instant::now() + self.heartbeat;
                self.awaiting_pong = false;
                self.outbox.iter_mut().for_each(|o| o.sent = false);
                self.flush().await;
                Ok(())
            }
            Ok(Err(tungstenite::Error::Http(response))) => {
                let error = HttpCallError::Status {
                    status: response.status(),
                    url: self.url.to_string(),
                    retry_after: crate::parse_retry_after(response.headers()),
                    body: String::from_utf8_lossy(response.body().as_deref().unwrap_or_default())
                        .into_owned(),
                };
                after_call_failure(&mut self.reconnect, error)
            }
            Ok(Err(
                error @ (tungstenite::Error::Protocol(_)
                | tungstenite::Error::Url(_)
                | tungstenite::Error::HttpFormat(_)),
            )) => {
                let error = LoopError::protocol(&self.url, error);
                Err(after_garbage(&mut self.reconnect, error))
            }
            Ok(Err(_)) => self.dropped("the handshake failed"),
            Err(_) => self.dropped("the handshake timed out"),
        }
    }

    /// The handshake request: the URL with `after`, the subprotocol and the
    /// configured headers.
    fn handshake(&self) -> Result<tungstenite::handshake::client::Request, LoopError> {
        let mut url = self.url.clone();
        if let Some(seq) = self.last_seq {
            let others: Vec<(String, String)> = url
                .query_pairs()
                .filter(|(key, _)| key != "after")
                .map(|(key, value)| (key.into_owned(), value.into_owned()))
                .collect();
            url.query_pairs_mut()
                .clear()
                .extend_pairs(others)
                .append_pair("after", &seq.to_string());
        }
        let mut request = url
            .as_str()
            .into_client_request()
            .map_err(|error| LoopError::protocol(&self.url, error))?;
        let headers = request.headers_mut();
        headers.insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(KEEL_SUBPROTOCOL),
        );
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        Ok(request)
    }
}

impl KeelSocketBuilder {
    /// The `Origin` header (Keel's server refuses handshakes from origins
    /// not on its allow-list).
    #[must_use]
    pub fn origin(self, origin: impl Into<String>) -> Self {
        self.header("origin", origin)
    }

    /// A header for every handshake (`authorization`, a cookie).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Starts after this seq (0: everything the server retains; a saved
    /// [`KeelSocket::last_seq`]). Without it the first connection starts
    /// live.
    #[must_use]
    pub fn after(mut self, seq: i64) -> Self {
        self.after = Some(seq);
        self
    }

    /// How failures are ridden out (default [`Reconnect::new`]).
    #[must_use]
    pub fn reconnect(mut self, reconnect: Reconnect) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// How often the client pings (default [`DEFAULT_WS_HEARTBEAT`]).
    #[must_use]
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    /// How many sent messages may wait for acks (default
    /// [`DEFAULT_WS_MAX_UNACKED`]).
    #[must_use]
    pub fn max_unacked(mut self, limit: usize) -> Self {
        self.max_unacked = limit;
        self
    }

    /// The socket; it connects on the first [`KeelSocket::next`] (a
    /// [`KeelSocket::send`] before that waits in the queue).
    ///
    /// # Errors
    ///
    /// [`LoopError::Protocol`] for a header that is not a valid HTTP header.
    pub fn build(self) -> Result<KeelSocket, LoopError> {
        let url = self.url;
        let headers = self
            .headers
            .into_iter()
            .map(|(name, value)| {
                match (
                    HeaderName::try_from(name.as_str()),
                    HeaderValue::try_from(value.as_str()),
                ) {
                    (Ok(name), Ok(value)) => Ok((name, value)),
                    _ => Err(LoopError::protocol(
                        &url,
                        format!("an invalid header {name:?}"),
                    )),
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(KeelSocket {
            url,
            headers,
            last_seq: self.after,
            outbox: VecDeque::new(),
            max_unacked: self.max_unacked,
            socket: None,
            reconnect: self.reconnect.start(),
            heartbeat: self.heartbeat,
            next_ping: Instant::now(),
            awaiting_pong: false,
            resend_at: None,
            policy_closed: None,
            connections: 0,
        })
    }
}
