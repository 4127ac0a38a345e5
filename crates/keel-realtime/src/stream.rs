//! Whose events: the stream id, and the application's say on who is asking.
//!
//! keel-realtime does not own authentication. The application answers one
//! question per request, "which stream may this caller read?", through
//! [`Authenticate`]: usually by reading what its own auth middleware put
//! into the request's extensions (a session, a verified JWT's subject).

use std::fmt;
use std::sync::Arc;

use axum::http::request::Parts;

/// The longest stream id accepted, in bytes.
pub const MAX_STREAM_ID_LEN: usize = 255;

/// A stream (usually one per user): non-empty, at most
/// [`MAX_STREAM_ID_LEN`] bytes, no control characters. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(Arc<str>);

/// A stream id was empty, too long, or had control characters in it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid stream id: use 1 to {MAX_STREAM_ID_LEN} bytes without control characters \
     (e.g. `user:42`)"
)]
pub struct InvalidStreamId;

impl StreamId {
    /// A stream id, checked.
    pub fn new(id: impl AsRef<str>) -> Result<Self, InvalidStreamId> {
        let id = id.as_ref();
        if id.is_empty() || id.len() > MAX_STREAM_ID_LEN || id.chars().any(char::is_control) {
            return Err(InvalidStreamId);
        }
        Ok(Self(Arc::from(id)))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for StreamId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for StreamId {
    type Error = InvalidStreamId;

    fn try_from(id: &str) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

impl TryFrom<String> for StreamId {
    type Error = InvalidStreamId;

    fn try_from(id: String) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

/// Which stream the caller of a request may read; `None` when it is not
/// authenticated (answered with `401` on long polling and SSE, and with a
/// `1008` close on WebSocket).
///
/// Any `Fn(&Parts) -> Option<StreamId>` is one. It runs on every request and
/// WebSocket handshake, so it must be cheap and synchronous: authenticate in
/// a middleware before the route (where you can await a session lookup) and
/// read the result from `parts.extensions` here.
///
/// ```
/// use axum::http::request::Parts;
/// use keel_realtime::StreamId;
///
/// #[derive(Clone)]
/// struct User { id: u64 } // put into the extensions by your auth middleware
///
/// let authenticate = |parts: &Parts| {
///     let user = parts.extensions.get::<User>()?;
///     StreamId::new(format!("user:{}", user.id)).ok()
/// };
/// # fn check(_: impl keel_realtime::Authenticate) {}
/// # check(authenticate);
/// ```
pub trait Authenticate: Send + Sync + 'static {
    /// The caller's stream, or `None` if unauthenticated.
    fn authenticate(&self, parts: &Parts) -> Option<StreamId>;
}

impl<F> Authenticate for F
where
    F: Fn(&Parts) -> Option<StreamId> + Send + Sync + 'static,
{
    fn authenticate(&self, parts: &Parts) -> Option<StreamId> {
        self(parts)
    }
}
