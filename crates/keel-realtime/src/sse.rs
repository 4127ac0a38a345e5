//! Server-Sent Events: one long response per client, resumable with
//! `Last-Event-ID`.
//!
//! # The frames
//!
//! ```text
//! retry: 4213                      <- first, alone: this connection's reconnect delay
//!
//! id: 42                           <- the seq: the browser sends it back as Last-Event-ID
//! event: order.shipped
//! retry: 4213
//! data: {"orderId":"A-4471"}
//!
//! : keepalive                      <- after 15 s of silence
//! ```
//!
//! `retry` is drawn once per connection between 2 and 8 s, so when a deploy
//! drops every connection at once they do not all come back in the same
//! 100 ms. It goes out first, on its own, so even a connection that never
//! sees an event (and is then drained) reconnects with its own delay. A
//! `: keepalive` comment goes out after 15 s without a frame, so NATs and
//! load balancers do not reap an idle stream. When retention removed events
//! the client had not seen, an `event: keel.truncated` frame (no `id`) with
//! `{"after": <cursor>, "next": <oldest seq left>}` comes before the rest.
//!
//! # Resume: no gap, no duplicate
//!
//! The cursor is `Last-Event-ID` (a reconnecting `EventSource` sends it),
//! else `?after=` (for the first connection of a page that knows where it
//! is), else 0 (everything retained). The handler subscribes *before* the
//! replay and holds live announcements until the replay is over; see
//! [`feed`](super::feed) for why that gives neither a gap nor a duplicate.
//!
//! # A slow client is cut off at 1 MiB
//!
//! A producer task per connection moves events from the log into a queue
//! bounded in bytes; the response body takes them out as the socket accepts
//! them. When live events would take the queue past the limit (1 MiB), the
//! client is not keeping up: the queue is dropped, the response is aborted,
//! `keel_sse_slow_client_total` is counted, and the client's `EventSource`
//! reconnects with `Last-Event-ID`, losing nothing. A replay, in contrast,
//! is paced by the client (see [`feed`](super::feed)).
//!
//! # Drain
//!
//! When the drain signal (see [`RealtimeBuilder::drain`](super::RealtimeBuilder::drain))
//! turns `true`, every stream ends cleanly after the frames already queued:
//! `EventSource` reconnects after its `retry` delay, to another instance. A
//! connection that arrives while draining gets its `retry` frame and an
//! immediate end (not an error status, which would stop `EventSource` for
//! good).
//!
//! # Headers
//!
//! `Content-Type: text/event-stream`, `Cache-Control: no-cache`, and
//! `X-Accel-Buffering: no` (nginx would otherwise buffer the stream).

use std::fmt::Write as _;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::Stream;
use keel_core::clock;
use keel_store::EventLogStore;

use super::cloudevents;
use super::feed::{Fed, Frame, Mode, TRUNCATED_EVENT, feed};
use super::notifier::Subscription;
use super::queue::{Pop, Push, Receiver, SendQueue};
use super::reject::{RealtimeRejection, refuse, sse_cursor};
use super::stream::StreamId;
use super::{Gauge, Realtime, wait_drain};

const TRANSPORT: &str = "sse";
const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// The SSE handler.
pub(crate) async fn handler<S: EventLogStore>(
    State(realtime): State<Realtime<S>>,
    request: Request,
) -> Response {
    let (parts, _body) = request.into_parts();
    let Some(stream) = realtime.authenticate(&parts) else {
        return refuse(TRANSPORT, RealtimeRejection::Unauthenticated);
    };
    let cursor = match sse_cursor(&parts) {
        Ok(cursor) => cursor,
        Err(rejection) => return refuse(TRANSPORT, rejection),
    };
    let retry = realtime.jittered_retry_ms();
    let retry_frame = Bytes::from(format!("retry: {retry}\n\n"));
    if realtime.is_draining() {
        metrics::counter!("keel_realtime_rejected_total", "transport" => TRANSPORT,
            "reason" => "draining")
        .increment(1);
        return event_stream(Body::from(retry_frame));
    }
    let Some(slot) = realtime.claim_slot(&parts) else {
        return refuse(TRANSPORT, RealtimeRejection::TooManyConnections);
    };
    // Subscribe BEFORE the replay (see `feed`).
    let subscription = realtime.log().subscribe(&stream);
    let (queue, receiver) = SendQueue::new(realtime.options().max_buffered);
    let size = retry_frame.len();
    let _ = queue.try_push(retry_frame, size);
    let producer = Producer {
        cloudevents: cloudevents::wanted(&parts),
        realtime,
        stream,
        subscription,
        last: cursor,
        retry,
        _slot: slot,
    };
    tokio::spawn(producer.run(queue));
    event_stream(Body::from_stream(SseBody {
        receiver,
        done: false,
    }))
}

fn event_stream(body: Body) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// Encodes one frame; with `cloud` (the stream and the source), an event's
/// data is a structured CloudEvent.
fn encode(frame: Frame<'_>, retry: u64, cloud: Option<&(StreamId, String)>) -> (Bytes, usize) {
    let mut text = String::new();
    match frame {
        Frame::Event(event) => {
            let data = match cloud {
                Some((stream, source)) => {
                    serde_json::to_string(&cloudevents::event(stream, event, source))
                }
                None => serde_json::to_string(&event.data),
            }
            .unwrap_or_else(|_| "null".to_owned());
            // `EventLog::append` refuses control characters; a row written
            // around it must still not break the framing.
            let event_type: std::borrow::Cow<'_, str> = if event.event_type.contains(['\r', '\n']) {
                event.event_type.replace(['\r', '\n'], " ").into()
            } else {
                event.event_type.as_str().into()
            };
            let _ = write!(
                text,
                "id: {}\nevent: {event_type}\nretry: {retry}\ndata: {data}\n\n",
                event.seq
            );
        }
        Frame::Truncated { after, next } => {
            let _ = write!(
                text,
                "event: {TRUNCATED_EVENT}\ndata: {{\"after\":{after},\"next\":{next}}}\n\n"
            );
        }
    }
    let size = text.len();
    (Bytes::from(text), size)
}

/// The task that moves one connection's events from the log to its queue.
struct Producer<S> {
    realtime: Realtime<S>,
    stream: StreamId,
    subscription: Subscription,
    /// The highest seq queued (or the client's cursor).
    last: i64,
    retry: u64,
    /// Whether each event's `data:` is a structured CloudEvent.
    cloudevents: bool,
    /// Held while the stream lives.
    _slot: super::slots::ClientSlot,
}

/// Why a producer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The client disconnected.
    Gone,
    /// The server is draining: end the stream cleanly.
    Drain,
    /// Live events overflowed the queue.
    Overflow,
    /// A catching-up client took nothing for the stall timeout.
    Stalled,
    /// The log could not be read.
    StoreFailed,
}

impl<S: EventLogStore> Producer<S> {
    async fn run(mut self, queue: std::sync::Arc<SendQueue<Bytes>>) {
        let _open = self.realtime.open(Gauge::Sse);
        let stop = self.pump(&queue).await;
        match stop {
            Stop::Gone => {}
            Stop::Drain => queue.close(None),
            Stop::Overflow | Stop::Stalled => {
                let reason = if stop == Stop::Overflow {
                    "buffer"
                } else {
                    "stalled"
                };
                tracing::info!(stream = %self.stream, reason, buffered = queue.buffered(),
                    "SSE client too slow; cut off (it resumes with Last-Event-ID)");
                metrics::counter!("keel_sse_slow_client_total", "reason" => reason).increment(1);
                self.realtime.count_slow_client(TRANSPORT);
                queue.abort(None);
            }
            Stop::StoreFailed => queue.abort(None),
        }
    }

    async fn pump(&mut self, queue: &SendQueue<Bytes>) -> Stop {
        let options = self.realtime.options();
        let batch = options.read_batch.get();
        let log = self.realtime.log();
        let retry = self.retry;
        let cloud = self
            .cloudevents
            .then(|| (self.stream.clone(), options.source.clone()));
        let mut drain = self.realtime.drain_signal();
        let mut catching_up = true;
        let mut keepalive_at = clock::now() + options.keepalive;
        let mut stall_at = clock::now() + options.stall_timeout;
        loop {
            let mode = tokio::select! {
                biased;
                () = queue.gone() => return Stop::Gone,
                () = wait_drain(&mut drain) => return Stop::Drain,
                () = queue.room(), if catching_up => Mode::CatchUp,
                () = tokio::time::sleep_until(stall_at), if catching_up => return Stop::Stalled,
                _ = self.subscription.wait_beyond(self.last), if !catching_up => Mode::Live,
                () = tokio::time::sleep_until(keepalive_at) => {
                    // Only when nothing is waiting: queued frames will do.
                    if queue.buffered() == 0 && queue.try_push(Bytes::from_static(KEEPALIVE), KEEPALIVE.len()) == Push::Gone {
                        return Stop::Gone;
                    }
                    keepalive_at = clock::now() + options.keepalive;
                    continue;
                }
            };
            let fed = feed(
                log,
                &self.stream,
                &mut self.last,
                batch,
                queue,
                mode,
                |frame| encode(frame, retry, cloud.as_ref()),
            )
            .await;
            match fed {
                Ok(Fed::CaughtUp) => catching_up = false,
                Ok(Fed::More) => {
                    if !catching_up {
                        stall_at = clock::now() + options.stall_timeout;
                    }
                    catching_up = true;
                }
                Ok(Fed::Overflow) => return Stop::Overflow,
                Ok(Fed::Gone) => return Stop::Gone,
                Err(err) => {
                    tracing::warn!(stream = %self.stream, error = %err,
                        "SSE stream ended: event log unreadable (the client resumes)");
                    metrics::counter!("keel_realtime_store_errors_total", "transport" => TRANSPORT)
                        .increment(1);
                    return Stop::StoreFailed;
                }
            }
            if mode == Mode::CatchUp {
                stall_at = clock::now() + options.stall_timeout;
            }
            keepalive_at = clock::now() + options.keepalive;
        }
    }
}

/// The slow client was cut off; the connection is aborted so the client
/// reconnects (with `Last-Event-ID`).
#[derive(Debug, thiserror::Error)]
#[error("SSE stream cut off: reconnect with Last-Event-ID")]
struct CutOff;

/// The response body: frames out of the queue.
struct SseBody {
    receiver: Receiver<Bytes>,
    done: bool,
}

impl Stream for SseBody {
    type Item = Result<Bytes, CutOff>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.receiver.poll_pop(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Pop::Item(frame)) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(Pop::End) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Pop::Aborted) => {
                this.done = true;
                Poll::Ready(Some(Err(CutOff)))
            }
        }
    }
}
