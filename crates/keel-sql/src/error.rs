//! Errors every backend reports the same way: a row that does not decode,
//! and numbers that do not fit.

use keel_store::StoreError;

/// A stored row that this version of Keel cannot read (a schema mismatch or
/// a row written by something else).
#[derive(Debug, thiserror::Error)]
#[error("unreadable {what} in the {db} store: {detail}")]
pub struct CorruptRow {
    db: &'static str,
    what: &'static str,
    detail: String,
}

/// A [`StoreError::Other`] for a value of `db`'s store that does not decode.
pub fn corrupt(db: &'static str, what: &'static str, detail: impl ToString) -> StoreError {
    StoreError::other(CorruptRow {
        db,
        what,
        detail: detail.to_string(),
    })
}

/// A count or id from SQL's `i64` into `u64` (negative → corrupt).
pub fn to_u64(what: &'static str, value: i64) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| corrupt("SQL", what, format!("negative value {value}")))
}

/// A step or attempt number from SQL's `i64` into `u32`.
pub fn to_u32(what: &'static str, value: i64) -> Result<u32, StoreError> {
    u32::try_from(value).map_err(|e| corrupt("SQL", what, e))
}

/// A `usize` limit as a SQL integer (saturating).
pub fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}
