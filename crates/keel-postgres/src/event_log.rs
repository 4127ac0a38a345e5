//! Per-user event logs on PostgreSQL: the storage behind `keel-http`'s long
//! polling, SSE and WebSocket push.
//!
//! A client that reconnects says "I have everything up to seq 41"; the log
//! must then hand it 42, 43, ... with nothing skipped. Seqs come from a
//! per-stream counter row bumped in the caller's own transaction: the bump
//! holds the row lock until COMMIT, so a second appender to the same stream
//! waits and gets the next seq, seqs are contiguous and in commit order, and
//! a rolled-back append leaves no hole. The counter survives trimming, so
//! seqs are never reused.
//!
//! The append also notifies the event-log channel with `<seq> <stream>`,
//! delivered at commit, so readers in every process wake up.
//!
//! Retention is two batched deletes, by age and by count per stream, each
//! bounded by `batch` so a trim never holds many locks for long.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{EventLogStore, LoggedEvent, Store};
use sqlx::Row;

use crate::PgStore;
use crate::store::codec::{now, to_json};
use crate::store::error::{corrupt, db_error, sql_limit};
use crate::store::retry::delete_batch;

/// Bumps the counter, inserts the event and notifies, in one statement.
const APPEND_SQL: &str = "\
WITH bumped AS (
  INSERT INTO keel_event_log_streams (stream, last_seq) VALUES ($1, 1)
  ON CONFLICT (stream) DO UPDATE SET last_seq = keel_event_log_streams.last_seq + 1
  RETURNING last_seq),
inserted AS (
  INSERT INTO keel_event_log (stream, seq, event_type, data, at)
  SELECT $1, last_seq, $2, $3::jsonb, $4 FROM bumped
  RETURNING seq)
SELECT seq, pg_notify($5, seq::text || ' ' || $1) FROM inserted";

const READ_SQL: &str = "\
SELECT seq, event_type, data::text AS data, at FROM keel_event_log
 WHERE stream = $1 AND seq > $2 ORDER BY seq LIMIT $3";

const LAST_SEQ_SQL: &str = "SELECT last_seq FROM keel_event_log_streams WHERE stream = $1";

const TRIM_AGE_SQL: &str = "\
DELETE FROM keel_event_log WHERE id IN (
  SELECT id FROM keel_event_log WHERE at < $1 ORDER BY at, id LIMIT $2 FOR UPDATE SKIP LOCKED)";

/// Each stream's events at or below `last_seq - keep`, through the
/// `(stream, seq)` unique index.
const TRIM_KEEP_SQL: &str = "\
DELETE FROM keel_event_log WHERE id IN (
  SELECT e.id FROM keel_event_log_streams s
    JOIN keel_event_log e ON e.stream = s.stream AND e.seq <= s.last_seq - $1
   LIMIT $2 FOR UPDATE OF e SKIP LOCKED)";

#[async_trait]
impl EventLogStore for PgStore {
    async fn event_log_append(
        &self,
        tx: &mut <Self as Store>::Tx,
        stream: &str,
        event_type: &str,
        data: &serde_json::Value,
    ) -> Result<i64, StoreError> {
        let row = sqlx::query(APPEND_SQL)
            .bind(stream)
            .bind(event_type)
            .bind(to_json(data)?)
            .bind(now())
            .bind(self.channels.event_log.as_str())
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)?;
        row.try_get("seq").map_err(db_error)
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
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter()
            .map(|row| {
                let seq: i64 = row.try_get("seq").map_err(db_error)?;
                let data: String = row.try_get("data").map_err(db_error)?;
                Ok(LoggedEvent {
                    seq,
                    event_type: row.try_get("event_type").map_err(db_error)?,
                    data: serde_json::from_str(&data).map_err(|e| corrupt("event log entry", e))?,
                    at: row.try_get("at").map_err(db_error)?,
                })
            })
            .collect()
    }

    async fn event_log_trim(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        delete_batch(&self.pool, "event_log_trim", TRIM_AGE_SQL, before, batch).await
    }

    async fn event_log_last_seq(&self, stream: &str) -> Result<i64, StoreError> {
        let seq: Option<i64> = sqlx::query_scalar(LAST_SEQ_SQL)
            .bind(stream)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(seq.unwrap_or(0))
    }

    async fn event_log_trim_keep_last(&self, keep: u64, batch: usize) -> Result<u64, StoreError> {
        let keep = i64::try_from(keep).unwrap_or(i64::MAX);
        delete_batch(
            &self.pool,
            "event_log_trim_keep_last",
            TRIM_KEEP_SQL,
            keep,
            batch,
        )
        .await
    }
}
