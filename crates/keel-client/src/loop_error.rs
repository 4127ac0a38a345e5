//! [`LoopError`]: why a client loop (long poll, SSE, WebSocket, job
//! polling) stopped, and the one rule for which failures it rides out.

use keel_core::{Classify, ErrorClass, Rejected};

use crate::HttpCallError;
use crate::reconnect::ReconnectState;

/// The most of a response body a client loop reads: 16 MiB. A longer answer
/// is a [`LoopError::Protocol`], not a growing buffer.
pub const LOOP_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// Why a client loop stopped. Failures the loop rides out (no connection, a
/// `5xx`, a `429`, a connection dropped mid-answer) never show up here
/// until [`Reconnect::max_failures`](crate::Reconnect::max_failures) of
/// them come in a row.
///
/// A loop that returned an error can be called again; it first waits its
/// reconnect delay, so a caller that retries every error in a loop does not
/// spin against a server that answers garbage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoopError {
    /// The current deadline leaves no time for another attempt, or a
    /// policy refused the call.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// The server refused the request for good (a `4xx` other than `429`:
    /// bad cursor, not signed in, not found, a refused WebSocket handshake),
    /// or the request could not be built. Retrying the same request will
    /// not help.
    #[error(transparent)]
    Call(HttpCallError),
    /// The server answered, but not in the protocol: a body that does not
    /// parse, a missing header, a cursor that goes backwards, a frame over
    /// the size limit. Something other than a Keel server (or a broken
    /// proxy) is answering at that URL.
    #[error("{url} does not speak the protocol: {detail}; check the URL and what answers it")]
    Protocol {
        /// Where the answer came from.
        url: String,
        /// What was wrong with it.
        detail: String,
    },
    /// [`Reconnect::max_failures`](crate::Reconnect::max_failures) failures
    /// came in a row.
    #[error("gave up after {failures} failures in a row; the last: {last}")]
    GaveUp {
        /// How many.
        failures: u32,
        /// The last one.
        last: String,
    },
    /// The WebSocket server closed with `1008` (policy violation: not
    /// signed in, not allowed). The client does not reconnect: sign in
    /// again and build a new one.
    #[error(
        "the server closed the socket for a policy violation: {reason}; reconnecting will not help"
    )]
    PolicyViolation {
        /// The close reason the server gave.
        reason: String,
    },
    /// Too many WebSocket messages wait for their ack; the new one was not
    /// queued. Keep reading ([`KeelSocket::next`](crate::KeelSocket::next))
    /// so acks can come in.
    #[error("{limit} messages already wait for their ack; this one was not queued")]
    Backlog {
        /// The limit.
        limit: usize,
    },
    /// The SSE server answered `204 No Content`: it asks the client to stop
    /// reconnecting.
    #[error("the server asked the client to stop (204 No Content)")]
    Ended,
}

impl LoopError {
    /// A [`Protocol`](Self::Protocol) error for `url`.
    pub(crate) fn protocol(url: impl ToString, detail: impl ToString) -> Self {
        Self::Protocol {
            url: url.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// What a loop does after a failed call: `Ok` when it should try again
/// (the wait is scheduled in `state`), the error when it should stop.
/// Either way the failure is counted, so the next attempt waits.
pub(crate) fn after_call_failure(
    state: &mut ReconnectState,
    error: HttpCallError,
) -> Result<(), LoopError> {
    match error.class() {
        ErrorClass::Retryable | ErrorClass::OutcomeUnknown => state
            .failed(error.retry_after())
            .map_err(|gave_up| LoopError::GaveUp {
                failures: gave_up.failures,
                last: error.to_string(),
            }),
        _ => {
            let _ = state.failed(None);
            Err(match error {
                HttpCallError::Rejected(rejected) => LoopError::Rejected(rejected),
                other => LoopError::Call(other),
            })
        }
    }
}

/// After the server answered garbage: counts the failure (so the next call
/// waits) and returns the error.
pub(crate) fn after_garbage(state: &mut ReconnectState, error: LoopError) -> LoopError {
    let _ = state.failed(None);
    error
}

/// The connection failed while an answer was read, or the answer came too
/// soon to be real: a failure to ride out.
#[cfg(any(feature = "long-poll", feature = "jobs"))]
pub(crate) fn after_failed_answer(state: &mut ReconnectState) -> Result<(), LoopError> {
    state.failed(None).map_err(|gave_up| LoopError::GaveUp {
        failures: gave_up.failures,
        last: "the connection failed while the answer was read, or it came too soon".into(),
    })
}

/// The whole body of `response`, or a protocol error when it is longer
/// than [`LOOP_BODY_LIMIT`] or the connection fails mid-body (then `Ok(None)`:
/// a transport failure the loop rides out).
#[cfg(any(feature = "long-poll", feature = "jobs"))]
pub(crate) async fn read_body(
    mut response: reqwest::Response,
) -> Result<Option<Vec<u8>>, LoopError> {
    let url = response.url().clone();
    if response
        .content_length()
        .is_some_and(|len| len > LOOP_BODY_LIMIT as u64)
    {
        return Err(LoopError::protocol(
            url,
            "the body is over the 16 MiB limit",
        ));
    }
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > LOOP_BODY_LIMIT {
                    return Err(LoopError::protocol(
                        url,
                        "the body is over the 16 MiB limit",
                    ));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(Some(body)),
            Err(_) => return Ok(None),
        }
    }
}
