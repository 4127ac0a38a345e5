//! Asynchronous jobs on SQLite: the storage behind `keel-http`'s
//! `202 Accepted` + `/jobs/{id}` pattern.
//!
//! A retried `POST` must return the *same* job, not start a second one. The
//! `UNIQUE (kind, idempotency_key)` constraint settles it: creation is
//! `INSERT ... ON CONFLICT DO NOTHING` followed by reading the row back in
//! the same transaction, so whichever request came second gets the first
//! one's job (and, since nothing was inserted, writes no outbox event).
//!
//! Updates are one conditional `UPDATE ... WHERE status IN ('queued',
//! 'running')`, so "refuse to leave a final state" cannot race: a client's
//! cancel and a worker's success are ordered by SQLite, and the loser is told.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{JobRecord, JobStatus, JobStore, Store};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::SqliteStore;
use crate::store::codec::from_ms;
use crate::store::error::db_error;

const COLUMNS: &str = "id, kind, idempotency_key, params, status, progress, result_location, \
                       error, created_at, updated_at, expires_at";

const INSERT_SQL: &str = "\
INSERT INTO keel_jobs (id, kind, idempotency_key, params, status, progress, result_location,
                       error, created_at, updated_at, expires_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
ON CONFLICT (kind, idempotency_key) DO NOTHING";

const UPDATE_SQL: &str = "\
UPDATE keel_jobs
   SET status = ?2, progress = ?3, result_location = ?4, error = ?5, updated_at = ?6,
       expires_at = ?7
 WHERE id = ?1 AND status IN ('queued', 'running')";

const PRUNE_SQL: &str = "\
DELETE FROM keel_jobs WHERE id IN (
  SELECT id FROM keel_jobs WHERE expires_at < ?1 ORDER BY expires_at LIMIT ?2)";

#[async_trait]
impl JobStore for SqliteStore {
    async fn job_create(
        &self,
        tx: &mut <Self as Store>::Tx,
        job: &JobRecord,
    ) -> Result<JobRecord, StoreError> {
        let params = serde_json::to_string(&job.params).map_err(StoreError::other)?;
        sqlx::query(INSERT_SQL)
            .bind(job.id.as_str())
            .bind(job.kind.as_str())
            .bind(job.idempotency_key.as_str())
            .bind(params)
            .bind(job.status.as_str())
            .bind(i64::from(job.progress.min(100)))
            .bind(job.result_location.as_deref())
            .bind(job.error.as_deref())
            .bind(job.created_at.timestamp_millis())
            .bind(job.updated_at.timestamp_millis())
            .bind(job.expires_at.timestamp_millis())
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM keel_jobs WHERE kind = ?1 AND idempotency_key = ?2"
        ))
        .bind(job.kind.as_str())
        .bind(job.idempotency_key.as_str())
        .fetch_one(&mut **tx)
        .await
        .map_err(db_error)?;
        job_from_row(&row)
    }

    async fn job_get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM keel_jobs WHERE id = ?1"))
            .bind(id)
            .fetch_optional(self.read_pool())
            .await
            .map_err(db_error)?;
        row.as_ref().map(job_from_row).transpose()
    }

    async fn job_update(&self, job: &JobRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(UPDATE_SQL)
            .bind(job.id.as_str())
            .bind(job.status.as_str())
            .bind(i64::from(job.progress.min(100)))
            .bind(job.result_location.as_deref())
            .bind(job.error.as_deref())
            .bind(keel_core::clock::utc_now().timestamp_millis())
            .bind(job.expires_at.timestamp_millis())
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM keel_jobs WHERE id = ?1")
            .bind(job.id.as_str())
            .fetch_optional(self.pool())
            .await
            .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(format!("job {:?}", job.id))),
        }
    }

    async fn job_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(PRUNE_SQL)
            .bind(before.timestamp_millis())
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        let deleted = done.rows_affected();
        if deleted > 0 {
            tracing::debug!(deleted, "expired jobs pruned");
        }
        Ok(deleted)
    }
}

fn job_from_row(row: &SqliteRow) -> Result<JobRecord, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let params: String = row.try_get("params").map_err(db_error)?;
    let progress: i64 = row.try_get("progress").map_err(db_error)?;
    Ok(JobRecord {
        id: row.try_get("id").map_err(db_error)?,
        kind: row.try_get("kind").map_err(db_error)?,
        idempotency_key: row.try_get("idempotency_key").map_err(db_error)?,
        params: serde_json::from_str(&params).map_err(|e| corrupt(e.to_string()))?,
        status: JobStatus::parse(&status).ok_or_else(|| corrupt(format!("status {status:?}")))?,
        progress: u8::try_from(progress.clamp(0, 100)).unwrap_or(100),
        result_location: row.try_get("result_location").map_err(db_error)?,
        error: row.try_get("error").map_err(db_error)?,
        created_at: from_ms(row.try_get("created_at").map_err(db_error)?)?,
        updated_at: from_ms(row.try_get("updated_at").map_err(db_error)?)?,
        expires_at: from_ms(row.try_get("expires_at").map_err(db_error)?)?,
    })
}

fn corrupt(detail: String) -> StoreError {
    StoreError::other(format!("unreadable job in the SQLite store: {detail}"))
}
