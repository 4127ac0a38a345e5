//! Dead letters and the failure history of messages still being retried.
//!
//! A dead letter keeps its error history as a `JSONB` array in its own row:
//! it is written once, read whole, and never queried by attempt. The failure
//! history of live messages is a table of its own, because it grows one
//! attempt at a time and is cleared when the message succeeds.

use async_trait::async_trait;
use bytes::Bytes;
use keel_messaging::StoreError;
use keel_messaging::broker::Message;
use keel_messaging::store::{
    AttemptError, DeadLetter, DeadLetterFilter, DeadLetterStatus, DeadLetterStore, Store,
};
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::PgStore;
use super::codec::{attempts_from_json, headers_from_json, now, to_json};
use super::error::{corrupt, db_error, sql_limit, to_u64};
use super::retry::retry;

/// The default of [`DeadLetterFilter::limit`].
const DEFAULT_LIMIT: usize = 100;

const COLUMNS: &str = "id, message_id, topic, partition_key, headers::text AS headers, payload, \
                       consumer_group, error_kind, attempts::text AS attempts, dead_at, status";

const PUT_SQL: &str = "\
INSERT INTO keel_dead_letters (id, message_id, topic, partition_key, headers, payload,
                               consumer_group, error_kind, attempts, dead_at, status)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9::jsonb, $10, $11)";

const SETTLE_SQL: &str = "\
UPDATE keel_dead_letters SET status = $1, settled_at = $2
 WHERE id = $3 AND status = 'pending'";

const COUNTS_SQL: &str = "\
SELECT error_kind, COUNT(*) FROM keel_dead_letters
 WHERE status = 'pending' GROUP BY error_kind ORDER BY error_kind";

/// Optional filters as nullable parameters: one prepared statement.
const LIST_SQL: &str = "\
SELECT id, message_id, topic, partition_key, headers::text AS headers, payload,
       consumer_group, error_kind, attempts::text AS attempts, dead_at, status
  FROM keel_dead_letters
 WHERE ($1::text IS NULL OR topic = $1)
   AND ($2::text IS NULL OR error_kind = $2)
   AND ($3::text IS NULL OR status = $3)
 ORDER BY dead_at, seq
 LIMIT $4";

const FAILURE_RECORD_SQL: &str = "\
INSERT INTO keel_failures (consumer_group, message_id, attempt, error, at)
VALUES ($1, $2, $3, $4, $5)";

const FAILURE_HISTORY_SQL: &str = "\
SELECT attempt, error, at FROM keel_failures
 WHERE consumer_group = $1 AND message_id = $2 ORDER BY at, seq";

const FAILURE_CLEAR_SQL: &str =
    "DELETE FROM keel_failures WHERE consumer_group = $1 AND message_id = $2";

#[async_trait]
impl DeadLetterStore for PgStore {
    async fn dead_letter_put(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        let message = &letter.message;
        let headers = to_json(&message.headers)?;
        let attempts = to_json(&letter.attempts)?;
        retry("dead_letter_put", || async {
            sqlx::query(PUT_SQL)
                .bind(letter.id.as_str())
                .bind(message.id.as_str())
                .bind(message.topic.as_str())
                .bind(message.key.as_str())
                .bind(headers.as_str())
                .bind(message.payload.as_ref())
                .bind(letter.group.as_str())
                .bind(letter.error_kind.as_str())
                .bind(attempts.as_str())
                .bind(letter.dead_at)
                .bind(letter.status.as_str())
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        tracing::debug!(id = %letter.id, kind = %letter.error_kind, "dead letter stored");
        Ok(())
    }

    async fn dead_letter_list(
        &self,
        filter: &DeadLetterFilter,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let limit = filter.limit.unwrap_or(DEFAULT_LIMIT);
        let rows = sqlx::query(LIST_SQL)
            .bind(filter.topic.as_deref())
            .bind(filter.error_kind.as_deref())
            .bind(filter.status.map(DeadLetterStatus::as_str))
            .bind(sql_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(letter_from_row).collect()
    }

    async fn dead_letter_get(&self, id: &str) -> Result<Option<DeadLetter>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM keel_dead_letters WHERE id = $1");
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.as_ref().map(letter_from_row).transpose()
    }

    async fn dead_letter_settle(
        &self,
        tx: &mut <Self as Store>::Tx,
        id: &str,
        status: DeadLetterStatus,
    ) -> Result<bool, StoreError> {
        if status == DeadLetterStatus::Pending {
            return Err(StoreError::other(
                "a dead letter cannot be settled as pending; settle it as replayed or discarded",
            ));
        }
        let done = sqlx::query(SETTLE_SQL)
            .bind(status.as_str())
            .bind(now())
            .bind(id)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn dead_letter_counts(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(COUNTS_SQL)
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.into_iter()
            .map(|(kind, n)| Ok((kind, to_u64("dead letter count", n)?)))
            .collect()
    }

    async fn failure_record(
        &self,
        group: &str,
        message_id: &str,
        failure: &AttemptError,
    ) -> Result<(), StoreError> {
        let attempt = i32::try_from(failure.attempt).unwrap_or(i32::MAX);
        retry("failure_record", || async {
            sqlx::query(FAILURE_RECORD_SQL)
                .bind(group)
                .bind(message_id)
                .bind(attempt)
                .bind(failure.error.as_str())
                .bind(failure.at)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn failure_history(
        &self,
        group: &str,
        message_id: &str,
    ) -> Result<Vec<AttemptError>, StoreError> {
        let rows: Vec<(i32, String, chrono::DateTime<chrono::Utc>)> =
            sqlx::query_as(FAILURE_HISTORY_SQL)
                .bind(group)
                .bind(message_id)
                .fetch_all(&self.pool)
                .await
                .map_err(db_error)?;
        rows.into_iter()
            .map(|(attempt, error, at)| {
                Ok(AttemptError {
                    attempt: u32::try_from(attempt).map_err(|e| corrupt("attempt number", e))?,
                    error,
                    at,
                })
            })
            .collect()
    }

    async fn failure_clear(&self, group: &str, message_id: &str) -> Result<(), StoreError> {
        retry("failure_clear", || async {
            sqlx::query(FAILURE_CLEAR_SQL)
                .bind(group)
                .bind(message_id)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }
}

fn letter_from_row(row: &PgRow) -> Result<DeadLetter, StoreError> {
    let headers: String = row.try_get("headers").map_err(db_error)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(db_error)?;
    let attempts: String = row.try_get("attempts").map_err(db_error)?;
    let status: String = row.try_get("status").map_err(db_error)?;
    Ok(DeadLetter {
        id: row.try_get("id").map_err(db_error)?,
        message: Message {
            id: row.try_get("message_id").map_err(db_error)?,
            topic: row.try_get("topic").map_err(db_error)?,
            key: row.try_get("partition_key").map_err(db_error)?,
            headers: headers_from_json(&headers)?,
            payload: Bytes::from(payload),
        },
        group: row.try_get("consumer_group").map_err(db_error)?,
        error_kind: row.try_get("error_kind").map_err(db_error)?,
        attempts: attempts_from_json(&attempts)?,
        dead_at: row.try_get("dead_at").map_err(db_error)?,
        status: DeadLetterStatus::parse(&status)
            .ok_or_else(|| corrupt("dead letter status", status))?,
    })
}
