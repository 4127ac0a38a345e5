//! Per-user event logs on SQLite: the storage behind `keel-http`'s long
//! polling, SSE and WebSocket push.
//!
//! A client that reconnects says "I have everything up to seq 41"; the log
//! must then hand it 42, 43, ... with nothing skipped. So seqs come from a
//! per-stream counter row (`keel_event_log_streams`) bumped in the caller's
//! own transaction: they are contiguous, in commit order (the store's single
//! writer connection serializes transactions), and never reused, because the
//! counter survives the trimming of the events themselves.
//!
//! Retention is two batched deletes, by age (`event_log_trim`) and by count
//! per stream (`event_log_trim_keep_last`), each bounded by `batch` so a
//! trim never holds the write lock for long.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{EventLogStore, LoggedEvent, Store};
use sqlx::Row;

use crate::SqliteStore;
use crate::store::error::db_error;

const BUMP_SQL: &str = "\
INSERT INTO keel_event_log_streams (stream, last_seq) VALUES (?1, 1)
ON CONFLICT (stream) DO UPDATE SET last_seq = last_seq + 1
RETURNING last_seq";

const INSERT_SQL: &str = "\
INSERT INTO keel_event_log (stream, seq, event_type, data, at) VALUES (?1, ?2, ?3, ?4, ?5)";

const READ_SQL: &str = "\
SELECT seq, event_type, data, at FROM keel_event_log
 WHERE stream = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3";

const LAST_SEQ_SQL: &str = "SELECT last_seq FROM keel_event_log_streams WHERE stream = ?1";

const TRIM_AGE_SQL: &str = "\
DELETE FROM keel_event_log WHERE id IN (
  SELECT id FROM keel_event_log WHERE at < ?1 ORDER BY at, id LIMIT ?2)";

/// Walks the streams and, through the `(stream, seq)` index, each stream's
/// events at or below `last_seq - keep`.
const TRIM_KEEP_SQL: &str = "\
DELETE FROM keel_event_log WHERE id IN (
  SELECT e.id FROM keel_event_log_streams s
    JOIN keel_event_log e ON e.stream = s.stream AND e.seq <= s.last_seq - ?1
   LIMIT ?2)";

#[async_trait]
impl EventLogStore for SqliteStore {
    async fn event_log_append(
        &self,
        tx: &mut <Self as Store>::Tx,
        stream: &str,
        event_type: &str,
        data: &serde_json::Value,
    ) -> Result<i64, StoreError> {
        let data = serde_json::to_string(data).map_err(StoreError::other)?;
        let seq: i64 = sqlx::query_scalar(BUMP_SQL)
            .bind(stream)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)?;
        sqlx::query(INSERT_SQL)
            .bind(stream)
            .bind(seq)
            .bind(event_type)
            .bind(data)
            .bind(keel_core::clock::utc_now().timestamp_millis())
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(seq)
    }

    async fn event_log_read_after(
        &self,
        stream: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<LoggedEvent>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(READ_SQL)
            .bind(stream)
            .bind(after)
            .bind(sql_limit(limit))
            .fetch_all(self.read_pool())
            .await
            .map_err(db_error)?;
        rows.iter().map(event_from_row).collect()
    }

    async fn event_log_trim(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(TRIM_AGE_SQL)
            .bind(before.timestamp_millis())
            .bind(sql_limit(batch))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected())
    }

    async fn event_log_last_seq(&self, stream: &str) -> Result<i64, StoreError> {
        let seq: Option<i64> = sqlx::query_scalar(LAST_SEQ_SQL)
            .bind(stream)
            .fetch_optional(self.read_pool())
            .await
            .map_err(db_error)?;
        Ok(seq.unwrap_or(0))
    }

    async fn event_log_trim_keep_last(&self, keep: u64, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(TRIM_KEEP_SQL)
            .bind(i64::try_from(keep).unwrap_or(i64::MAX))
            .bind(sql_limit(batch))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected())
    }
}

fn event_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<LoggedEvent, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(db_error)?;
    let event_type: String = row.try_get("event_type").map_err(db_error)?;
    let data: String = row.try_get("data").map_err(db_error)?;
    let at: i64 = row.try_get("at").map_err(db_error)?;
    let data = serde_json::from_str(&data).map_err(|err| {
        StoreError::other(format!(
            "unreadable event log entry (seq {seq}) in the SQLite store: {err}"
        ))
    })?;
    Ok(LoggedEvent {
        seq,
        event_type,
        data,
        at: DateTime::from_timestamp_millis(at).unwrap_or(DateTime::UNIX_EPOCH),
    })
}

/// A `usize` limit as a SQL integer (saturating).
fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}
