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
use super::super::options::MAX_CLIENT_ID_LEN;
use super::SendMessage;

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

/// A client message, read and checked: what the connection acts on.
#[derive(Debug)]
pub(crate) enum Request {
    /// A message for the application, with a usable id.
    Send(SendMessage),
    /// Replay after this seq (0 or more).
    Resume {
        /// The last seq the client has.
        after: i64,
    },
}

/// Reads one text frame: a `send` with a usable id or a `resume` at a
/// sequence number; anything else is the detail of the `error` to answer.
pub(crate) fn read(text: &str) -> Result<Request, String> {
    let message = serde_json::from_str::<ClientMessage>(text).map_err(|err| {
        format!(
            "unreadable message ({err}); expected {{\"type\":\"send\",\"id\":\"...\",...}} \
             or {{\"type\":\"resume\",\"after\":<seq>}}"
        )
    })?;
    match message {
        ClientMessage::Resume { after } if after < 0 => {
            Err("`after` must be a sequence number (0 or more)".to_owned())
        }
        ClientMessage::Resume { after } => Ok(Request::Resume { after }),
        ClientMessage::Send { id, .. }
            if id.is_empty()
                || id.len() > MAX_CLIENT_ID_LEN
                || id.chars().any(char::is_control) =>
        {
            Err("`id` must be 1 to 255 bytes without control characters (a UUID)".to_owned())
        }
        ClientMessage::Send { id, body } => Ok(Request::Send(SendMessage { id, body })),
    }
}

/// [`read`] for the fuzz target (`cargo fuzz` builds with `--cfg
/// fuzzing`): the id of a `send`, or the seq of a `resume`, or the JSON
/// text of the `error` the server answers.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn fuzz_read(text: &str) -> Result<Result<String, i64>, String> {
    match read(text) {
        Ok(Request::Send(message)) => Ok(Ok(message.id)),
        Ok(Request::Resume { after }) => Ok(Err(after)),
        Err(detail) => Err(Control::Error { detail: &detail }.to_text()),
    }
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
