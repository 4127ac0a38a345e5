//! Saga instances on PostgreSQL, saved with optimistic concurrency.
//!
//! A save is one `UPDATE ... WHERE id = $1 AND version = $10`: if another
//! worker saved first, no row matches and the caller learns it lost, without
//! locks held across steps. Inserts and saves notify the sagas channel, so a
//! worker in another process can pick up a new or rescheduled saga at once.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{SagaFilter, SagaRecord, SagaStatus, SagaStore, Store};
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::PgStore;
use super::codec::to_json;
use super::error::{corrupt, db_error, sql_limit, to_u64};
use super::retry::retry;

/// The default of [`SagaFilter::limit`].
const DEFAULT_LIMIT: usize = 100;

const COLUMNS: &str = "id, kind, status, step, data::text AS data, attempts, last_error, \
                       next_attempt_at, created_at, updated_at, version, \
                       outcome_unknown, first_attempt_at";

/// Inserts unless the id exists, and notifies only if it inserted.
const INSERT_SQL: &str = "\
WITH inserted AS (
  INSERT INTO keel_sagas (id, kind, status, step, data, attempts, last_error,
                          next_attempt_at, created_at, updated_at, version,
                          outcome_unknown, first_attempt_at)
  VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11, $13, $14)
  ON CONFLICT (id) DO NOTHING
  RETURNING id)
SELECT id, pg_notify($12, '') FROM inserted";

/// Everything but `id` and `created_at`, if the stored version is `$10`.
const SAVE_SQL: &str = "\
WITH saved AS (
  UPDATE keel_sagas
     SET kind = $2, status = $3, step = $4, data = $5::jsonb, attempts = $6, last_error = $7,
         next_attempt_at = $8, updated_at = $9, version = $11,
         outcome_unknown = $13, first_attempt_at = $14
   WHERE id = $1 AND version = $10
  RETURNING id)
SELECT id, pg_notify($12, '') FROM saved";

/// Not terminal and due; the `status IN (...)` term matches the partial
/// index's predicate.
const DUE_SQL: &str = "\
SELECT id, kind, status, step, data::text AS data, attempts, last_error,
       next_attempt_at, created_at, updated_at, version,
       outcome_unknown, first_attempt_at
  FROM keel_sagas
 WHERE status IN ('running', 'compensating', 'stuck') AND next_attempt_at <= $1
 ORDER BY next_attempt_at, created_at, id
 LIMIT $2";

const LIST_SQL: &str = "\
SELECT id, kind, status, step, data::text AS data, attempts, last_error,
       next_attempt_at, created_at, updated_at, version,
       outcome_unknown, first_attempt_at
  FROM keel_sagas
 WHERE ($1::text IS NULL OR status = $1)
   AND ($2::timestamptz IS NULL OR updated_at < $2)
 ORDER BY updated_at, id
 LIMIT $3";

const COUNTS_SQL: &str = "SELECT status, COUNT(*) FROM keel_sagas GROUP BY status ORDER BY status";

#[async_trait]
impl SagaStore for PgStore {
    async fn saga_insert(
        &self,
        tx: &mut <Self as Store>::Tx,
        saga: &SagaRecord,
    ) -> Result<bool, StoreError> {
        let data = to_json(&saga.data)?;
        let inserted = sqlx::query(INSERT_SQL)
            .bind(saga.id.as_str())
            .bind(saga.kind.as_str())
            .bind(saga.status.as_str())
            .bind(i64::from(saga.step))
            .bind(data)
            .bind(i64::from(saga.attempts))
            .bind(saga.last_error.as_deref())
            .bind(saga.next_attempt_at)
            .bind(saga.created_at)
            .bind(saga.updated_at)
            .bind(saga.version)
            .bind(self.channels.sagas.as_str())
            .bind(saga.outcome_unknown)
            .bind(saga.first_attempt_at)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(inserted.is_some())
    }

    async fn saga_get(&self, id: &str) -> Result<Option<SagaRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM keel_sagas WHERE id = $1");
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.as_ref().map(saga_from_row).transpose()
    }

    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError> {
        let data = to_json(&saga.data)?;
        let saved = retry("saga_save", || async {
            sqlx::query(SAVE_SQL)
                .bind(saga.id.as_str())
                .bind(saga.kind.as_str())
                .bind(saga.status.as_str())
                .bind(i64::from(saga.step))
                .bind(data.as_str())
                .bind(i64::from(saga.attempts))
                .bind(saga.last_error.as_deref())
                .bind(saga.next_attempt_at)
                .bind(saga.updated_at)
                .bind(saga.version.saturating_sub(1))
                .bind(saga.version)
                .bind(self.channels.sagas.as_str())
                .bind(saga.outcome_unknown)
                .bind(saga.first_attempt_at)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        if saved.is_some() {
            return Ok(true);
        }
        // Lost the race, or there was nothing to save.
        let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM keel_sagas WHERE id = $1")
            .bind(saga.id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(format!("saga {}", saga.id))),
        }
    }

    async fn saga_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(DUE_SQL)
            .bind(now)
            .bind(sql_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(saga_from_row).collect()
    }

    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError> {
        let limit = filter.limit.unwrap_or(DEFAULT_LIMIT);
        let rows = sqlx::query(LIST_SQL)
            .bind(filter.status.map(SagaStatus::as_str))
            .bind(filter.updated_before)
            .bind(sql_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(saga_from_row).collect()
    }

    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(COUNTS_SQL)
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.into_iter()
            .map(|(status, n)| {
                let parsed =
                    SagaStatus::parse(&status).ok_or_else(|| corrupt("saga status", &status))?;
                Ok((parsed, to_u64("saga count", n)?))
            })
            .collect()
    }
}

fn saga_from_row(row: &PgRow) -> Result<SagaRecord, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let data: String = row.try_get("data").map_err(db_error)?;
    let step: i64 = row.try_get("step").map_err(db_error)?;
    let attempts: i64 = row.try_get("attempts").map_err(db_error)?;
    Ok(SagaRecord {
        id: row.try_get("id").map_err(db_error)?,
        kind: row.try_get("kind").map_err(db_error)?,
        status: SagaStatus::parse(&status).ok_or_else(|| corrupt("saga status", &status))?,
        step: u32::try_from(step).map_err(|e| corrupt("saga step", e))?,
        data: serde_json::from_str(&data).map_err(|e| corrupt("saga data", e))?,
        attempts: u32::try_from(attempts).map_err(|e| corrupt("saga attempts", e))?,
        last_error: row.try_get("last_error").map_err(db_error)?,
        next_attempt_at: row.try_get("next_attempt_at").map_err(db_error)?,
        created_at: row.try_get("created_at").map_err(db_error)?,
        updated_at: row.try_get("updated_at").map_err(db_error)?,
        version: row.try_get("version").map_err(db_error)?,
        outcome_unknown: row.try_get("outcome_unknown").map_err(db_error)?,
        first_attempt_at: row.try_get("first_attempt_at").map_err(db_error)?,
    })
}
