//! One WebSocket connection: a loop reading the client, the log and the
//! timers, and a writer task draining the bounded outgoing queue.
//!
//! The writer is separate so that a client that stops reading blocks only
//! the writer: the loop keeps noticing the drain signal, missed pongs and
//! the queue's limit, and can close the connection.

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use keel_core::clock;
use keel_store::EventLogStore;
use tokio::time::{Instant, MissedTickBehavior};

use super::super::feed::{Fed, Mode, feed};
use super::super::notifier::Subscription;
use super::super::queue::{Pop, Push, Receiver, SendQueue};
use super::super::stream::StreamId;
use super::super::{Gauge, Realtime, wait_drain};
use super::acks::Begin;
use super::protocol::{self, Control, Request, frame_text};
use super::{SendMessage, SendRejected, TRANSPORT};

/// Why the loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The client closed or the socket failed.
    Gone,
    /// The client broke the protocol (e.g. a message over the size limit):
    /// close with this code.
    Refused(u16),
    /// The server is draining: close `1001`.
    Drain,
    /// Live messages overflowed the queue: close `1013`.
    Overflow,
    /// A catching-up client took nothing for the stall timeout: `1013`.
    Stalled,
    /// No pong since the last ping: terminate.
    HeartbeatMissed,
    /// The log could not be read: close `1011`.
    StoreFailed,
}

/// Serves an authenticated socket until it ends.
pub(super) async fn run<S: EventLogStore>(
    realtime: Realtime<S>,
    socket: WebSocket,
    stream: StreamId,
    after: Option<i64>,
) {
    let _open = realtime.open(Gauge::WebSocket);
    // Subscribe before finding the cursor, so nothing falls in between.
    let subscription = realtime.log().subscribe(&stream);
    let (sink, incoming) = socket.split();
    let (queue, receiver) = SendQueue::new(realtime.options().max_buffered);
    let writer = tokio::spawn(write_loop(sink, receiver));
    let (last, catching_up, stop) = match after {
        Some(after) => (after, true, None),
        None => match realtime.log().last_seq(&stream).await {
            Ok(last) => (last, false, None),
            Err(err) => {
                tracing::warn!(%stream, error = %err, "WebSocket closed: event log unreadable");
                (0, false, Some(Stop::StoreFailed))
            }
        },
    };
    let mut connection = Connection {
        realtime,
        stream,
        subscription,
        queue: Arc::clone(&queue),
        last,
        catching_up,
        stall_at: clock::now(),
        awaiting_pong: false,
    };
    let stop = match stop {
        Some(stop) => stop,
        None => connection.serve(incoming).await,
    };
    connection.finish(stop, writer).await;
}

struct Connection<S> {
    realtime: Realtime<S>,
    stream: StreamId,
    subscription: Subscription,
    queue: Arc<SendQueue<Message>>,
    /// The highest seq queued (or the client's cursor).
    last: i64,
    catching_up: bool,
    stall_at: Instant,
    awaiting_pong: bool,
}

impl<S: EventLogStore> Connection<S> {
    async fn serve(&mut self, mut incoming: SplitStream<WebSocket>) -> Stop {
        let options = self.realtime.options();
        let mut drain = self.realtime.drain_signal();
        let every = options.ping_interval;
        let mut ping = tokio::time::interval_at(clock::now() + every, every);
        ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
        self.stall_at = clock::now() + options.stall_timeout;
        loop {
            let queue = Arc::clone(&self.queue);
            let mode = tokio::select! {
                biased;
                () = queue.gone() => return Stop::Gone,
                () = wait_drain(&mut drain) => return Stop::Drain,
                message = incoming.next() => {
                    match self.on_message(message).await {
                        Some(stop) => return stop,
                        None => continue,
                    }
                }
                () = queue.room(), if self.catching_up => Mode::CatchUp,
                () = tokio::time::sleep_until(self.stall_at), if self.catching_up => {
                    return Stop::Stalled;
                }
                _ = self.subscription.wait_beyond(self.last), if !self.catching_up => Mode::Live,
                _ = ping.tick() => {
                    if self.awaiting_pong {
                        return Stop::HeartbeatMissed;
                    }
                    self.awaiting_pong = true;
                    match queue.try_push(Message::Ping(bytes::Bytes::new()), 1) {
                        Push::Queued => continue,
                        Push::Full => return Stop::Overflow,
                        Push::Gone => return Stop::Gone,
                    }
                }
            };
            if let Some(stop) = self.feed(mode).await {
                return stop;
            }
        }
    }

    async fn feed(&mut self, mode: Mode) -> Option<Stop> {
        let batch = self.realtime.options().read_batch.get();
        let stall = self.realtime.options().stall_timeout;
        let fed = feed(
            self.realtime.log(),
            &self.stream,
            &mut self.last,
            batch,
            &self.queue,
            mode,
            |frame| {
                let text = frame_text(frame);
                let size = text.len();
                (Message::Text(text.into()), size)
            },
        )
        .await;
        match fed {
            Ok(Fed::CaughtUp) => self.catching_up = false,
            Ok(Fed::More) => {
                if !self.catching_up || mode == Mode::CatchUp {
                    self.stall_at = clock::now() + stall;
                }
                self.catching_up = true;
            }
            Ok(Fed::Overflow) => return Some(Stop::Overflow),
            Ok(Fed::Gone) => return Some(Stop::Gone),
            Err(err) => {
                tracing::warn!(stream = %self.stream, error = %err,
                    "WebSocket closed: event log unreadable (the client resumes)");
                metrics::counter!("keel_realtime_store_errors_total", "transport" => TRANSPORT)
                    .increment(1);
                return Some(Stop::StoreFailed);
            }
        }
        None
    }

    async fn on_message(&mut self, message: Option<Result<Message, axum::Error>>) -> Option<Stop> {
        match message {
            None | Some(Ok(Message::Close(_))) => Some(Stop::Gone),
            Some(Err(err)) => Some(read_failure(&err)),
            Some(Ok(Message::Pong(_))) => {
                self.awaiting_pong = false;
                None
            }
            Some(Ok(Message::Ping(_))) => None, // answered by the socket itself
            Some(Ok(Message::Binary(_))) => self.control(&Control::Error {
                detail: "binary messages are not part of keel.v1: send JSON text",
            }),
            Some(Ok(Message::Text(text))) => self.on_text(text.as_str()).await,
        }
    }

    async fn on_text(&mut self, text: &str) -> Option<Stop> {
        let request = match protocol::read(text) {
            Ok(request) => request,
            Err(detail) => return self.control(&Control::Error { detail: &detail }),
        };
        match request {
            Request::Resume { after } => {
                self.last = after;
                if !self.catching_up {
                    self.stall_at = clock::now() + self.realtime.options().stall_timeout;
                }
                self.catching_up = true;
                None
            }
            Request::Send(message) => self.on_send(message).await,
        }
    }

    async fn on_send(&mut self, message: SendMessage) -> Option<Stop> {
        let id = message.id.clone();
        let realtime = self.realtime.clone();
        let in_flight = match realtime.acks().begin(&self.stream, &id) {
            Begin::Duplicate => {
                tracing::debug!(stream = %self.stream, id, "duplicate client message acked again");
                metrics::counter!("keel_ws_duplicate_total").increment(1);
                realtime.count_duplicate();
                return self.control(&Control::Ack { id: &id });
            }
            Begin::Busy => {
                return self.control(&Control::Nack {
                    id: &id,
                    retryable: true,
                    detail: "a message with this id is still being handled; resend it later",
                });
            }
            Begin::New(in_flight) => in_flight,
        };
        let Some(handler) = realtime.on_send() else {
            return self.control(&Control::Nack {
                id: &id,
                retryable: false,
                detail: "this endpoint does not accept messages",
            });
        };
        let timeout = realtime.options().send_timeout;
        let outcome = tokio::time::timeout(timeout, handler.on_send(&self.stream, message)).await;
        match outcome {
            Ok(Ok(())) => {
                in_flight.succeeded();
                self.control(&Control::Ack { id: &id })
            }
            Ok(Err(rejected)) => {
                let retryable = matches!(rejected, SendRejected::Unavailable(_));
                let detail = rejected.to_string();
                self.control(&Control::Nack {
                    id: &id,
                    retryable,
                    detail: &detail,
                })
            }
            Err(_elapsed) => {
                tracing::warn!(stream = %self.stream, id, ?timeout, "WebSocket send handler timed out");
                self.control(&Control::Nack {
                    id: &id,
                    retryable: true,
                    detail: "handling timed out; resend it with the same id",
                })
            }
        }
    }

    /// Queues a control message; a full queue means the client is behind.
    fn control(&self, control: &Control<'_>) -> Option<Stop> {
        let text = control.to_text();
        let size = text.len();
        match self.queue.try_push(Message::Text(text.into()), size) {
            Push::Queued => None,
            Push::Full => Some(Stop::Overflow),
            Push::Gone => Some(Stop::Gone),
        }
    }

    async fn finish(self, stop: Stop, writer: tokio::task::JoinHandle<()>) {
        let close = |code, reason: &'static str| {
            let frame = Message::Close(Some(CloseFrame {
                code,
                reason: reason.into(),
            }));
            Some((frame, 1))
        };
        match stop {
            Stop::Gone => self.queue.close(None),
            Stop::Drain => self
                .queue
                .close(close(close_code::AWAY, "server shutting down; reconnect")),
            Stop::Overflow | Stop::Stalled => {
                let reason = if stop == Stop::Overflow {
                    "buffer"
                } else {
                    "stalled"
                };
                tracing::info!(stream = %self.stream, reason, buffered = self.queue.buffered(),
                    "WebSocket client falling behind; closed with 1013 (it resumes)");
                metrics::counter!("keel_ws_slow_client_total", "reason" => reason).increment(1);
                self.realtime.count_slow_client(TRANSPORT);
                self.queue.abort(close(
                    close_code::AGAIN,
                    "falling behind; reconnect and resume",
                ));
            }
            Stop::HeartbeatMissed => {
                tracing::info!(stream = %self.stream, "WebSocket pong missed; connection terminated");
                metrics::counter!("keel_ws_heartbeat_timeout_total").increment(1);
                self.realtime.count_heartbeat_timeout();
                self.queue.abort(None);
                writer.abort();
                return;
            }
            Stop::StoreFailed => self.queue.abort(close(
                close_code::ERROR,
                "internal error; reconnect and resume",
            )),
            Stop::Refused(code) => {
                let reason = if code == close_code::SIZE {
                    "message too big"
                } else {
                    "protocol error"
                };
                self.queue.abort(close(code, reason));
            }
        }
        let timeout = self.realtime.options().close_timeout;
        let abort = writer.abort_handle();
        if tokio::time::timeout(timeout, writer).await.is_err() {
            abort.abort();
        }
    }
}

/// What to do after reading from the socket failed: a message over the size
/// limit is answered with `1009`; any other failure (a protocol violation,
/// or the connection is gone, when the close frame is simply lost) with
/// `1002`. The socket library only says which in its error's text.
fn read_failure(err: &axum::Error) -> Stop {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    let mut too_big = false;
    while let Some(err) = source {
        let text = err.to_string();
        too_big |= text.contains("Space limit exceeded") || text.contains("too long");
        source = err.source();
    }
    tracing::debug!(error = %err, too_big, "WebSocket read failed");
    Stop::Refused(if too_big {
        close_code::SIZE
    } else {
        close_code::PROTOCOL
    })
}

/// Sends what the queue yields until it ends or the socket fails.
async fn write_loop(mut sink: SplitSink<WebSocket, Message>, mut receiver: Receiver<Message>) {
    loop {
        match receiver.pop().await {
            Pop::Item(message) => {
                if sink.send(message).await.is_err() {
                    return;
                }
            }
            Pop::End | Pop::Aborted => {
                let _ = sink.close().await;
                return;
            }
        }
    }
}
