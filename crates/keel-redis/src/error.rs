//! What went wrong talking to Redis, in the store's terms.

use keel_store::StoreError;
use redis::RedisError;

/// A [`RedisLeases`](crate::RedisLeases) could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisConfigError {
    /// The URL is not a Redis URL (`redis://host:port/db`,
    /// `rediss://` for TLS is not compiled in).
    #[error("`{url}` is not a Redis URL: {source}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why the client refused it.
        #[source]
        source: RedisError,
    },
    /// A setting is out of range.
    #[error("{field} {problem}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// The store error for a failed call: refused before anything was sent is
/// `Unavailable` (nothing happened); a connection that dropped or timed out
/// with the command on its way is `OutcomeUnknown` (the script may have
/// run); anything else Redis answered is `Other`.
pub(crate) fn store_error(err: RedisError) -> StoreError {
    if err.is_connection_refusal() {
        StoreError::Unavailable(Box::new(err))
    } else if err.is_timeout() || err.is_connection_dropped() || err.is_io_error() {
        StoreError::OutcomeUnknown(Box::new(err))
    } else {
        StoreError::other(err)
    }
}
