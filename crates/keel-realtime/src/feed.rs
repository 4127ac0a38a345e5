//! Moving events from the log into a connection's bounded send queue, the part
//! SSE and WebSocket share.
//!
//! # Subscribe before replay, with no gap and no duplicate
//!
//! A connection subscribes to its stream *before* its first read of the log.
//! While it replays, announcements only raise the subscription's high-water
//! seq (they are "held"); once the replay is done, the connection reads the
//! log after the last seq it queued. An event committed during the replay is
//! therefore read exactly once: by the replay if it was committed before the
//! replay's last read, otherwise after the wake-up, and a seq at or below the
//! cursor is never read again.
//!
//! # Catching up is not being slow
//!
//! Two phases treat a full queue differently:
//!
//! - **catching up** (the replay, or a live burst bigger than one read):
//!   reading is pull-driven; the next batch is read only once the queue is at
//!   most half full, so a client on a slow link replaying a long backlog is
//!   paced, never cut off (unless it takes nothing at all for the stall
//!   timeout);
//! - **live**: new events are queued as soon as they are announced; a push
//!   that would take the queue over its limit means the client is not keeping
//!   up with its stream, and it is cut off. It reconnects with its cursor and
//!   loses nothing, and its replay is paced.

use keel_store::StoreError;
use keel_store::{EventLogStore, LoggedEvent};

use super::log::EventLog;
use super::queue::{Push, SendQueue};
use super::stream::StreamId;

/// The event type of the notice that events were trimmed before the client
/// could read them.
pub const TRUNCATED_EVENT: &str = "keel.truncated";

/// What to queue.
#[derive(Debug)]
pub(crate) enum Frame<'a> {
    /// An event of the log.
    Event(&'a LoggedEvent),
    /// Events after `after` and before `next` were trimmed by retention.
    Truncated {
        /// The client's cursor.
        after: i64,
        /// The oldest event still in the log.
        next: i64,
    },
}

/// How a full queue is treated (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Stop and read again when there is room.
    CatchUp,
    /// The client is too slow.
    Live,
}

/// The outcome of one [`feed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fed {
    /// Everything after the cursor is queued.
    CaughtUp,
    /// There is more to read (a full batch, or the queue filled up).
    More,
    /// Live events did not fit: cut the client off.
    Overflow,
    /// The consumer left.
    Gone,
}

/// Reads one batch after `*last` and queues it, advancing `*last` past
/// every event queued.
pub(crate) async fn feed<S, T>(
    log: &EventLog<S>,
    stream: &StreamId,
    last: &mut i64,
    batch: usize,
    queue: &SendQueue<T>,
    mode: Mode,
    encode: impl Fn(Frame<'_>) -> (T, usize),
) -> Result<Fed, StoreError>
where
    S: EventLogStore,
{
    let events = log.read_after(stream, *last, batch).await?;
    let full = events.len() >= batch;
    let refused = |push: Push| match (push, mode) {
        (Push::Gone, _) => Some(Fed::Gone),
        (Push::Full, Mode::CatchUp) => Some(Fed::More),
        (Push::Full, Mode::Live) => Some(Fed::Overflow),
        (Push::Queued, _) => None,
    };
    if let Some(first) = events.first()
        && *last > 0
        && first.seq > *last + 1
    {
        let (item, size) = encode(Frame::Truncated {
            after: *last,
            next: first.seq,
        });
        if let Some(outcome) = refused(queue.try_push(item, size)) {
            return Ok(outcome);
        }
        tracing::info!(%stream, after = *last, next = first.seq, "client cursor behind retention");
        metrics::counter!("keel_realtime_truncated_total").increment(1);
        *last = first.seq - 1;
    }
    for event in &events {
        let (item, size) = encode(Frame::Event(event));
        if let Some(outcome) = refused(queue.try_push(item, size)) {
            return Ok(outcome);
        }
        *last = event.seq;
    }
    Ok(if full { Fed::More } else { Fed::CaughtUp })
}
