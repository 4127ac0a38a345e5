//! How Keel's values are stored: timestamps as `TIMESTAMPTZ`, headers,
//! histories and documents as `JSONB` (sent and read as text, cast in SQL).

use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::broker::Headers;
use serde::Serialize;

use super::error::corrupt;

/// Now, as stored: truncated to microseconds, PostgreSQL's precision, so a
/// value read back compares equal to the one written.
pub(crate) fn now() -> DateTime<Utc> {
    let now = keel_core::clock::utc_now();
    DateTime::from_timestamp_micros(now.timestamp_micros()).unwrap_or(now)
}

/// A value as JSON text.
pub(crate) fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(StoreError::other)
}

/// Headers from their JSON object.
pub(crate) fn headers_from_json(json: &str) -> Result<Headers, StoreError> {
    serde_json::from_str(json).map_err(|e| corrupt("headers", e))
}
