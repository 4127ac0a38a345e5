//! The `keel.v1` messages, as JSON text frames.
//!
//! Client to server:
//!
//! - `{"type": "send", "id": "<client message id>", ...}`: the rest of the
//!   object goes to the application's [`OnSend`](super::OnSend); answered
//!   with `{"type": "ack", "id"}` once handled (also for a duplicate id,
//!   without handling it again), or `{"type": "nack", "id", "retryable",
//!   "detail"}`;
//! - `{"type": "resume", "after": <seq>}`: replays the stream after `seq`,
//!   then continues live.
//!
//! Server to client:
//!
//! - events: `{"type": "<event type>", "seq": <seq>, "data": ...}`; only
//!   events have a `seq`, so a client tells them from control messages by
//!   it, and remembers the highest for its next `resume`;
//! - `{"type": "keel.truncated", "after", "next"}`: events between were
//!   trimmed by retention before the client read them;
//! - `{"type": "error", "detail"}`: a message the server could not read.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::super::feed::{Frame, TRUNCATED_EVENT};

/// A message from the client.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ClientMessage {
    /// A message for the application.
    Send {
        /// The client's id for it; resends reuse it.
        id: String,
        /// Everything else in the object.
        #[serde(flatten)]
        body: Map<String, Value>,
    },
    /// Replay after a seq.
    Resume {
        /// The last seq the client has.
        after: i64,
    },
}

/// A control message to the client.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Control<'a> {
    /// The `send` with this id was handled (maybe before).
    Ack {
        /// The client's message id.
        id: &'a str,
    },
    /// The `send` with this id was not handled.
    Nack {
        /// The client's message id.
        id: &'a str,
        /// Whether resending the same id later may succeed.
        retryable: bool,
        /// Why.
        detail: &'a str,
    },
    /// A client message could not be read.
    Error {
        /// What was wrong.
        detail: &'a str,
    },
}

impl Control<'_> {
    /// The JSON text.
    pub(crate) fn to_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

#[derive(Serialize)]
struct EventMessage<'a> {
    #[serde(rename = "type")]
    event_type: &'a str,
    seq: i64,
    data: &'a Value,
}

#[derive(Serialize)]
struct TruncatedMessage {
    #[serde(rename = "type")]
    kind: &'static str,
    after: i64,
    next: i64,
}

/// The JSON text of a pushed frame.
pub(crate) fn frame_text(frame: Frame<'_>) -> String {
    let text = match frame {
        Frame::Event(event) => serde_json::to_string(&EventMessage {
            event_type: &event.event_type,
            seq: event.seq,
            data: &event.data,
        }),
        Frame::Truncated { after, next } => serde_json::to_string(&TruncatedMessage {
            kind: TRUNCATED_EVENT,
            after,
            next,
        }),
    };
    text.unwrap_or_default()
}
