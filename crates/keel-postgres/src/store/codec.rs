//! How Keel's values are stored: timestamps as `TIMESTAMPTZ`, headers,
//! histories and documents as `JSONB` (the shared core's side of it is
//! [`super::PgDialect`], which sends and reads documents as `JSONB`'s
//! binary format without parsing them).

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use serde::Serialize;

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
