//! The outbox's SQLite half: append and claim (the rest is the shared
//! core's `keel_sql::outbox`).
//!
//! Both are one statement on the hot path: append is one multi-row `INSERT`
//! per 64 events, and a claim is one `UPDATE ... RETURNING` that selects and
//! leases in a single step on the store's single writer, which is what
//! keeps two claims from taking rows of one key at once.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use keel_sql::outbox::OutboxBackend;
use keel_store::OutboxRecord;
use keel_store::StoreError;
use sqlx::sqlite::SqliteRow;

use super::SqliteStore;
use super::codec::{headers_to_json, to_ms};
use super::error::{db_error, sql_limit};

/// Rows per `INSERT` statement (6 parameters each, far below SQLite's limit).
const APPEND_CHUNK: usize = 64;

/// `INSERT` statements for 1..=APPEND_CHUNK rows; index `n - 1` has `n`.
static APPEND_SQL: LazyLock<Vec<String>> = LazyLock::new(|| {
    (1..=APPEND_CHUNK)
        .map(|n| {
            let rows = vec!["(?, ?, ?, ?, ?, ?)"; n].join(", ");
            format!(
                "INSERT INTO keel_outbox \
                 (event_id, topic, partition_key, headers, payload, created_at) VALUES {rows}"
            )
        })
        .collect()
});

/// Leases up to `$4` unpublished rows to relay `$1` until `$2`, lowest id
/// first, given the time `$3` (see [`OutboxBackend::claim_rows`]).
pub(super) const CLAIM_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = $1, claimed_until = $2
 WHERE id IN (
   SELECT o.id FROM keel_outbox o
    WHERE o.published_at IS NULL
      AND o.parked_at IS NULL
      AND (o.claimed_until IS NULL OR o.claimed_until <= $3 OR o.claimed_by = $1)
      AND NOT EXISTS (
        SELECT 1 FROM keel_outbox e
         WHERE e.partition_key = o.partition_key
           AND e.published_at IS NULL
           AND e.id < o.id
           AND (e.parked_at IS NOT NULL OR (e.claimed_until > $3 AND e.claimed_by <> $1)))
    ORDER BY o.id
    LIMIT $4)
RETURNING id, event_id, topic, partition_key, headers, payload, created_at, attempts";

impl OutboxBackend for SqliteStore {
    async fn append_rows(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        records: &[OutboxRecord],
        created_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let created_at = to_ms(created_at);
        for chunk in records.chunks(APPEND_CHUNK) {
            let mut query = sqlx::query(sqlx::AssertSqlSafe(APPEND_SQL[chunk.len() - 1].as_str()));
            for record in chunk {
                query = query
                    .bind(record.event_id.as_str())
                    .bind(record.topic.as_str())
                    .bind(record.partition_key.as_str())
                    .bind(headers_to_json(&record.headers)?)
                    .bind(record.payload.as_ref())
                    .bind(created_at);
            }
            query.execute(&mut **tx).await.map_err(db_error)?;
        }
        Ok(())
    }

    async fn claim_rows(
        &self,
        relay: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SqliteRow>, StoreError> {
        let claim = sqlx::query(CLAIM_SQL)
            .bind(relay)
            .bind(to_ms(until))
            .bind(to_ms(now))
            .bind(sql_limit(limit));
        self.claim(claim).await
    }
}
