//! The transactional outbox on PostgreSQL.
//!
//! Append is one statement per call whatever the number of events
//! (`INSERT ... SELECT FROM UNNEST(arrays)`), and it sends `pg_notify` on
//! the outbox channel in the same statement: the notification leaves when
//! the business transaction commits, and never if it rolls back.
//!
//! # Claims
//!
//! A claim leases rows to a relay: `UPDATE ... SET claimed_by, claimed_until`
//! over the lowest unpublished ids that nobody else holds, selected `FOR
//! UPDATE SKIP LOCKED`, so a relay never waits behind rows another relay is
//! marking or releasing and never takes them. The lease is what keeps two
//! relays from publishing one row; it also brings a crashed relay's rows
//! back when it ends.
//!
//! Per-key order needs one more thing. A row may only be claimed if no
//! earlier unpublished row of its key is leased by another relay; but that
//! check reads the *committed* claims, and two claims running at the same
//! moment each see the other's rows as free (and `SKIP LOCKED` hides the
//! rows the other is locking rather than showing them as taken). So claims
//! take a transaction-scoped advisory lock for the schema's outbox first:
//! claims are serialized (each is one statement over a partial index, so
//! the lock is held for a millisecond), while appends, marks and releases
//! never touch that lock. A claim is one call of the function
//! `keel_outbox_claim` (migration 1501; 1502 makes it skip parked rows and
//! the later rows of their keys), which takes the lock and then
//! leases with a fresh snapshot: one round trip, not four.
//!
//! # Late commits
//!
//! Identity values are handed out at `INSERT`, not at `COMMIT`, so id 7 can
//! commit after id 8 was published. The claim keeps no high-water mark: it
//! always scans the unpublished rows from the lowest id (through the partial
//! index of unpublished rows), so row 7 is claimed by the first claim after
//! it commits.
//!
//! # Pruning
//!
//! Each prune deletes at most `batch` published rows chosen `FOR UPDATE SKIP
//! LOCKED` (`DELETE ... WHERE id IN (SELECT ... LIMIT n)`), one short
//! autocommit statement per batch: it never waits for a lock and never holds
//! many.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    OutboxRecord, OutboxStats, OutboxStore, ParkedFilter, ParkedOutbox, PendingOutbox, Store,
};
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::PgStore;
use super::codec::{headers_from_json, now, to_json};
use super::error::{db_error, sql_limit, to_u64};
use super::retry::{delete_batch, retry};

/// Inserts the rows given as parallel arrays and notifies the outbox
/// channel, in one statement.
const APPEND_SQL: &str = "\
WITH inserted AS (
  INSERT INTO keel_outbox (event_id, topic, partition_key, headers, payload, created_at)
  SELECT e, t, k, h::jsonb, p, $6
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[]) AS r(e, t, k, h, p)
  RETURNING 1)
SELECT pg_notify($7, '') FROM (SELECT COUNT(*) FROM inserted) AS done";

/// Leases up to `$5` unpublished rows to relay `$2` until `$3`, lowest id
/// first, given the time `$4`, under the schema's claim lock `$1`: one
/// statement and one round trip (migration 1502 has the function, and the
/// SQL).
const CLAIM_SQL: &str = "SELECT * FROM keel_outbox_claim($1, $2, $3, $4, $5)";

const MARK_SQL: &str = "\
UPDATE keel_outbox SET published_at = $1, claimed_by = NULL, claimed_until = NULL
 WHERE id = ANY($2) AND published_at IS NULL";

const RELEASE_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL
 WHERE id = ANY($1) AND published_at IS NULL";

pub(super) const PRUNE_SQL: &str = "\
DELETE FROM keel_outbox WHERE id IN (
  SELECT id FROM keel_outbox WHERE published_at < $1
   ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

const STATS_SQL: &str = "\
SELECT COUNT(*) FILTER (WHERE parked_at IS NULL), MIN(created_at) FILTER (WHERE parked_at IS NULL),
       COUNT(*) FILTER (WHERE parked_at IS NOT NULL)
  FROM keel_outbox WHERE published_at IS NULL";

const RELEASE_FAILED_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1,
       last_error = $2
 WHERE id = ANY($1) AND published_at IS NULL";

const PARK_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1,
       last_error = $2, parked_at = $3
 WHERE id = $1 AND published_at IS NULL AND parked_at IS NULL";

const UNPARK_SQL: &str = "\
UPDATE keel_outbox SET parked_at = NULL, attempts = 0, last_error = NULL
 WHERE id = $1 AND published_at IS NULL AND parked_at IS NOT NULL";

const DISCARD_SQL: &str =
    "DELETE FROM keel_outbox WHERE id = $1 AND published_at IS NULL AND parked_at IS NOT NULL";

const PARKED_SQL: &str = "\
SELECT o.id, o.event_id, o.topic, o.partition_key, o.headers::text AS headers, o.payload,
       o.created_at, o.attempts, o.parked_at, o.last_error,
       (SELECT COUNT(*) FROM keel_outbox e
         WHERE e.partition_key = o.partition_key AND e.published_at IS NULL
           AND e.id > o.id) AS held_back
  FROM keel_outbox o
 WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL
   AND ($1::text IS NULL OR o.topic = $1) AND ($2::bigint IS NULL OR o.id = $2)
 ORDER BY o.id LIMIT $3";

#[async_trait]
impl OutboxStore for PgStore {
    async fn outbox_append(
        &self,
        tx: &mut <Self as Store>::Tx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        let mut ids = Vec::with_capacity(records.len());
        let mut topics = Vec::with_capacity(records.len());
        let mut keys = Vec::with_capacity(records.len());
        let mut headers = Vec::with_capacity(records.len());
        let mut payloads = Vec::with_capacity(records.len());
        for record in records {
            ids.push(record.event_id.as_str());
            topics.push(record.topic.as_str());
            keys.push(record.partition_key.as_str());
            headers.push(to_json(&record.headers)?);
            payloads.push(record.payload.as_ref());
        }
        sqlx::query(APPEND_SQL)
            .bind(ids)
            .bind(topics)
            .bind(keys)
            .bind(headers)
            .bind(payloads)
            .bind(now())
            .bind(self.channels.outbox.as_str())
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
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
        let lease = chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::MAX);
        let lock_key = format!("{}.outbox_claim", self.schema);
        let rows = retry("outbox_claim", || async {
            let now = now();
            let until = now
                .checked_add_signed(lease)
                .unwrap_or(DateTime::<Utc>::MAX_UTC);
            // An unknown outcome needs no resolving: the rows are leased to
            // this relay or to nobody, and its next claim takes its own
            // leases back.
            sqlx::query(CLAIM_SQL)
                .bind(lock_key.as_str())
                .bind(relay)
                .bind(until)
                .bind(now)
                .bind(sql_limit(limit))
                .fetch_all(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
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
        retry("outbox_mark_published", || async {
            sqlx::query(MARK_SQL)
                .bind(now())
                .bind(ids)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn outbox_release(&self, ids: &[i64]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        retry("outbox_release", || async {
            sqlx::query(RELEASE_SQL)
                .bind(ids)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        delete_batch(&self.pool, "outbox_prune", PRUNE_SQL, before, batch).await
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        let row = sqlx::query(STATS_SQL)
            .fetch_one(&self.pool)
            .await
            .map_err(db_error)?;
        let unpublished: i64 = row.try_get(0).map_err(db_error)?;
        let oldest: Option<DateTime<Utc>> = row.try_get(1).map_err(db_error)?;
        let parked: i64 = row.try_get(2).map_err(db_error)?;
        let age = oldest.map(|created| {
            (keel_core::clock::utc_now() - created)
                .to_std()
                .unwrap_or_default()
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
        retry("outbox_release_failed", || async {
            sqlx::query(RELEASE_FAILED_SQL)
                .bind(ids)
                .bind(error)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let done = retry("outbox_park", || async {
            sqlx::query(PARK_SQL)
                .bind(id)
                .bind(error)
                .bind(now())
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn outbox_parked(&self, filter: &ParkedFilter) -> Result<Vec<ParkedOutbox>, StoreError> {
        let rows = sqlx::query(PARKED_SQL)
            .bind(filter.topic.as_deref())
            .bind(None::<i64>)
            .bind(sql_limit(filter.limit.unwrap_or(100)))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(parked_from_row).collect()
    }

    async fn outbox_parked_get(&self, id: i64) -> Result<Option<ParkedOutbox>, StoreError> {
        let row = sqlx::query(PARKED_SQL)
            .bind(None::<&str>)
            .bind(Some(id))
            .bind(1_i64)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.as_ref().map(parked_from_row).transpose()
    }

    async fn outbox_unpark(&self, id: i64) -> Result<bool, StoreError> {
        let done = retry("outbox_unpark", || async {
            sqlx::query(UNPARK_SQL)
                .bind(id)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn outbox_discard(&self, id: i64) -> Result<bool, StoreError> {
        let done = retry("outbox_discard", || async {
            sqlx::query(DISCARD_SQL)
                .bind(id)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(done.rows_affected() > 0)
    }
}

fn pending_from_row(row: &PgRow) -> Result<PendingOutbox, StoreError> {
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
        created_at: row.try_get("created_at").map_err(db_error)?,
        attempts: attempts_from(row)?,
    })
}

fn attempts_from(row: &PgRow) -> Result<u32, StoreError> {
    let attempts: i32 = row.try_get("attempts").map_err(db_error)?;
    Ok(u32::try_from(attempts).unwrap_or(0))
}

fn parked_from_row(row: &PgRow) -> Result<ParkedOutbox, StoreError> {
    let pending = pending_from_row(row)?;
    let last_error: Option<String> = row.try_get("last_error").map_err(db_error)?;
    Ok(ParkedOutbox {
        id: pending.id,
        record: pending.record,
        created_at: pending.created_at,
        parked_at: row.try_get("parked_at").map_err(db_error)?,
        attempts: pending.attempts,
        last_error: last_error.unwrap_or_default(),
        held_back: to_u64("held back", row.try_get("held_back").map_err(db_error)?)?,
    })
}
