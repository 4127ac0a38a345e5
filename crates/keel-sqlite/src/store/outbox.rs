//! The transactional outbox on SQLite.
//!
//! Every hot path is one statement: append is one multi-row `INSERT` per 64
//! events, claim is one `UPDATE ... RETURNING` that selects and leases in a
//! single step, and mark/release take any number of ids through
//! `json_each(?)`, so the statement is prepared once.
//!
//! The claim always scans the unpublished rows from the lowest id, through
//! a partial index that holds only those rows; it keeps no high-water mark,
//! so a row that commits after a higher id (impossible in SQLite, where
//! writers are serialized, but the contract says so) is claimed next time.

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    OutboxRecord, OutboxStats, OutboxStore, ParkedFilter, ParkedOutbox, PendingOutbox, Store,
};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::SqliteStore;
use super::codec::{
    duration_ms, from_ms, headers_from_json, headers_to_json, ids_to_json, now_ms, to_ms,
};
use super::error::{db_error, sql_limit, to_u64};

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

/// Leases up to `?4` unpublished rows to relay `?1` until `?2`, lowest id
/// first, given the time `?3`. A row is claimable when it is not parked,
/// nobody holds a live lease on it but us, and no earlier unpublished row
/// of its key is parked or leased by another relay (which would publish it
/// first only by luck).
pub(super) const CLAIM_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = ?1, claimed_until = ?2
 WHERE id IN (
   SELECT o.id FROM keel_outbox o
    WHERE o.published_at IS NULL
      AND o.parked_at IS NULL
      AND (o.claimed_until IS NULL OR o.claimed_until <= ?3 OR o.claimed_by = ?1)
      AND NOT EXISTS (
        SELECT 1 FROM keel_outbox e
         WHERE e.partition_key = o.partition_key
           AND e.published_at IS NULL
           AND e.id < o.id
           AND (e.parked_at IS NOT NULL OR (e.claimed_until > ?3 AND e.claimed_by <> ?1)))
    ORDER BY o.id
    LIMIT ?4)
RETURNING id, event_id, topic, partition_key, headers, payload, created_at, attempts";

const MARK_SQL: &str = "\
UPDATE keel_outbox SET published_at = ?1, claimed_by = NULL, claimed_until = NULL
 WHERE id IN (SELECT value FROM json_each(?2)) AND published_at IS NULL";

const RELEASE_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL
 WHERE id IN (SELECT value FROM json_each(?1)) AND published_at IS NULL";

pub(super) const PRUNE_SQL: &str = "\
DELETE FROM keel_outbox WHERE id IN (
  SELECT id FROM keel_outbox WHERE published_at < ?1 ORDER BY published_at LIMIT ?2)";

pub(super) const STATS_SQL: &str = "\
SELECT COALESCE(SUM(parked_at IS NULL), 0), MIN(CASE WHEN parked_at IS NULL THEN created_at END),
       COALESCE(SUM(parked_at IS NOT NULL), 0)
  FROM keel_outbox WHERE published_at IS NULL";

const RELEASE_FAILED_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1,
       last_error = ?2
 WHERE id IN (SELECT value FROM json_each(?1)) AND published_at IS NULL";

const PARK_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1,
       last_error = ?2, parked_at = ?3
 WHERE id = ?1 AND published_at IS NULL AND parked_at IS NULL";

const UNPARK_SQL: &str = "\
UPDATE keel_outbox SET parked_at = NULL, attempts = 0, last_error = NULL
 WHERE id = ?1 AND published_at IS NULL AND parked_at IS NOT NULL";

const DISCARD_SQL: &str =
    "DELETE FROM keel_outbox WHERE id = ?1 AND published_at IS NULL AND parked_at IS NOT NULL";

/// A parked row with the count of unpublished rows of its key behind it.
const PARKED_COLUMNS: &str = "\
o.id, o.event_id, o.topic, o.partition_key, o.headers, o.payload, o.created_at, o.attempts,
o.parked_at, o.last_error,
(SELECT COUNT(*) FROM keel_outbox e
  WHERE e.partition_key = o.partition_key AND e.published_at IS NULL AND e.id > o.id) AS held_back";

#[async_trait]
impl OutboxStore for SqliteStore {
    async fn outbox_append(
        &self,
        tx: &mut <Self as Store>::Tx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError> {
        let created_at = now_ms();
        for chunk in records.chunks(APPEND_CHUNK) {
            let mut query = sqlx::query(&APPEND_SQL[chunk.len() - 1]);
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

    async fn outbox_claim(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let rows = sqlx::query(CLAIM_SQL)
            .bind(relay)
            .bind(now.saturating_add(duration_ms(lease)))
            .bind(now)
            .bind(sql_limit(limit))
            .fetch_all(&self.writer)
            .await
            .map_err(db_error)?;
        let mut claimed = rows
            .iter()
            .map(pending_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        // RETURNING does not promise an order.
        claimed.sort_unstable_by_key(|p| p.id);
        if !claimed.is_empty() {
            tracing::trace!(relay, claimed = claimed.len(), "outbox rows claimed");
        }
        Ok(claimed)
    }

    async fn outbox_mark_published(&self, ids: &[i64]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(MARK_SQL)
            .bind(now_ms())
            .bind(ids_to_json(ids)?)
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn outbox_release(&self, ids: &[i64]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(RELEASE_SQL)
            .bind(ids_to_json(ids)?)
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(PRUNE_SQL)
            .bind(to_ms(before))
            .bind(sql_limit(batch))
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        let deleted = done.rows_affected();
        if deleted > 0 {
            tracing::debug!(deleted, "outbox pruned");
        }
        Ok(deleted)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        let row = sqlx::query(STATS_SQL)
            .fetch_one(&self.reader)
            .await
            .map_err(db_error)?;
        let unpublished: i64 = row.try_get(0).map_err(db_error)?;
        let oldest: Option<i64> = row.try_get(1).map_err(db_error)?;
        let parked: i64 = row.try_get(2).map_err(db_error)?;
        let age = oldest.map(|created| {
            let ms = now_ms().saturating_sub(created).max(0);
            Duration::from_millis(u64::try_from(ms).unwrap_or(0))
        });
        Ok(OutboxStats {
            unpublished: to_u64("outbox count", unpublished)?,
            oldest_unpublished_age: age,
            parked: to_u64("parked count", parked)?,
        })
    }

    async fn outbox_release_failed(&self, ids: &[i64], error: &str) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(RELEASE_FAILED_SQL)
            .bind(ids_to_json(ids)?)
            .bind(error)
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(PARK_SQL)
            .bind(id)
            .bind(error)
            .bind(now_ms())
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() > 0)
    }

    async fn outbox_parked(&self, filter: &ParkedFilter) -> Result<Vec<ParkedOutbox>, StoreError> {
        let sql = format!(
            "SELECT {PARKED_COLUMNS} FROM keel_outbox o \
             WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL \
               AND (?1 IS NULL OR o.topic = ?1) \
             ORDER BY o.id LIMIT ?2"
        );
        let rows = sqlx::query(&sql)
            .bind(filter.topic.as_deref())
            .bind(sql_limit(filter.limit.unwrap_or(100)))
            .fetch_all(&self.reader)
            .await
            .map_err(db_error)?;
        rows.iter().map(parked_from_row).collect()
    }

    async fn outbox_parked_get(&self, id: i64) -> Result<Option<ParkedOutbox>, StoreError> {
        let sql = format!(
            "SELECT {PARKED_COLUMNS} FROM keel_outbox o \
             WHERE o.id = ?1 AND o.parked_at IS NOT NULL AND o.published_at IS NULL"
        );
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.reader)
            .await
            .map_err(db_error)?;
        row.as_ref().map(parked_from_row).transpose()
    }

    async fn outbox_unpark(&self, id: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(UNPARK_SQL)
            .bind(id)
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() > 0)
    }

    async fn outbox_discard(&self, id: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(DISCARD_SQL)
            .bind(id)
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() > 0)
    }
}

fn pending_from_row(row: &SqliteRow) -> Result<PendingOutbox, StoreError> {
    let headers: String = row.try_get("headers").map_err(db_error)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(db_error)?;
    Ok(PendingOutbox {
        id: row.try_get("id").map_err(db_error)?,
        record: OutboxRecord {
            event_id: row.try_get("event_id").map_err(db_error)?,
            topic: row.try_get("topic").map_err(db_error)?,
            partition_key: row.try_get("partition_key").map_err(db_error)?,
            headers: headers_from_json(&headers)?,
            payload: Bytes::from(payload),
        },
        created_at: from_ms(row.try_get("created_at").map_err(db_error)?)?,
        attempts: attempts_from(row)?,
    })
}

fn attempts_from(row: &SqliteRow) -> Result<u32, StoreError> {
    let attempts: i64 = row.try_get("attempts").map_err(db_error)?;
    Ok(u32::try_from(attempts).unwrap_or(u32::MAX))
}

fn parked_from_row(row: &SqliteRow) -> Result<ParkedOutbox, StoreError> {
    let pending = pending_from_row(row)?;
    let last_error: Option<String> = row.try_get("last_error").map_err(db_error)?;
    Ok(ParkedOutbox {
        id: pending.id,
        record: pending.record,
        created_at: pending.created_at,
        parked_at: from_ms(row.try_get("parked_at").map_err(db_error)?)?,
        attempts: pending.attempts,
        last_error: last_error.unwrap_or_default(),
        held_back: to_u64("held back", row.try_get("held_back").map_err(db_error)?)?,
    })
}
