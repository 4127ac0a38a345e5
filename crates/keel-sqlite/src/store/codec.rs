//! How Keel's values are stored: timestamps as Unix milliseconds (UTC),
//! headers and error histories as JSON text (the shared core's side of it
//! is [`super::SqliteDialect`]).
//!
//! Integer milliseconds sort and compare as numbers in SQL, which RFC 3339
//! text only does while every writer uses the same format and offset. The
//! price is sub-millisecond precision, which no messaging decision needs.

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::broker::Headers;

use super::error::corrupt;

/// A timestamp as stored.
pub(crate) fn to_ms(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

/// A stored timestamp.
pub(crate) fn from_ms(ms: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_millis(ms).ok_or_else(|| corrupt("timestamp", ms))
}

/// Headers as a JSON object.
pub(crate) fn headers_to_json(headers: &Headers) -> Result<String, StoreError> {
    serde_json::to_string(headers).map_err(StoreError::other)
}
