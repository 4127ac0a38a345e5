//! Asynchronous jobs on PostgreSQL: the storage behind `keel-http`'s
//! `202 Accepted` + `/jobs/{id}` pattern.
//!
//! A retried `POST` must return the *same* job. The `UNIQUE (kind,
//! idempotency_key)` constraint settles it: creation is `INSERT ... ON
//! CONFLICT DO NOTHING` and then a read of the row in the same transaction.
//! A concurrent creator with the same key waits for the first one's
//! transaction; once it commits, the second inserts nothing and reads the
//! first one's job (a fresh snapshot per statement in `READ COMMITTED`).
//!
//! Updates are one conditional `UPDATE ... WHERE status IN ('queued',
//! 'running')`: a client's cancel and a worker's success are ordered by the
//! row lock, and the loser is told.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{JobRecord, JobStatus, JobStore, Store};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::PgStore;
use crate::store::codec::{now, to_json};
use crate::store::error::{corrupt, db_error};
use crate::store::retry::{delete_batch, retry};

const COLUMNS: &str = "id, kind, idempotency_key, params::text AS params, status, progress, \
                       result_location, error, created_at, updated_at, expires_at";

const INSERT_SQL: &str = "\
INSERT INTO keel_jobs (id, kind, idempotency_key, params, status, progress, result_location,
                       error, created_at, updated_at, expires_at)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (kind, idempotency_key) DO NOTHING";

const UPDATE_SQL: &str = "\
UPDATE keel_jobs
   SET status = $2, progress = $3, result_location = $4, error = $5, updated_at = $6,
       expires_at = $7
 WHERE id = $1 AND status IN ('queued', 'running')";

const PRUNE_SQL: &str = "\
DELETE FROM keel_jobs WHERE id IN (
  SELECT id FROM keel_jobs WHERE expires_at < $1 ORDER BY expires_at LIMIT $2
     FOR UPDATE SKIP LOCKED)";

#[async_trait]
impl JobStore for PgStore {
    async fn job_create(
        &self,
        tx: &mut <Self as Store>::Tx,
        job: &JobRecord,
    ) -> Result<JobRecord, StoreError> {
        sqlx::query(INSERT_SQL)
            .bind(job.id.as_str())
            .bind(job.kind.as_str())
            .bind(job.idempotency_key.as_str())
            .bind(to_json(&job.params)?)
            .bind(job.status.as_str())
            .bind(i16::from(job.progress.min(100)))
            .bind(job.result_location.as_deref())
            .bind(job.error.as_deref())
            .bind(job.created_at)
            .bind(job.updated_at)
            .bind(job.expires_at)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM keel_jobs WHERE kind = $1 AND idempotency_key = $2"
        ))
        .bind(job.kind.as_str())
        .bind(job.idempotency_key.as_str())
        .fetch_one(&mut **tx)
        .await
        .map_err(db_error)?;
        job_from_row(&row)
    }

    async fn job_get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM keel_jobs WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.as_ref().map(job_from_row).transpose()
    }

    async fn job_update(&self, job: &JobRecord) -> Result<bool, StoreError> {
        let done = retry("job_update", || async {
            sqlx::query(UPDATE_SQL)
                .bind(job.id.as_str())
                .bind(job.status.as_str())
                .bind(i16::from(job.progress.min(100)))
                .bind(job.result_location.as_deref())
                .bind(job.error.as_deref())
                .bind(now())
                .bind(job.expires_at)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM keel_jobs WHERE id = $1")
            .bind(job.id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(format!("job {:?}", job.id))),
        }
    }

    async fn job_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        delete_batch(&self.pool, "job_prune", PRUNE_SQL, before, batch).await
    }
}

fn job_from_row(row: &PgRow) -> Result<JobRecord, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let params: String = row.try_get("params").map_err(db_error)?;
    let progress: i16 = row.try_get("progress").map_err(db_error)?;
    Ok(JobRecord {
        id: row.try_get("id").map_err(db_error)?,
        kind: row.try_get("kind").map_err(db_error)?,
        idempotency_key: row.try_get("idempotency_key").map_err(db_error)?,
        params: serde_json::from_str(&params).map_err(|e| corrupt("job params", e))?,
        status: JobStatus::parse(&status).ok_or_else(|| corrupt("job status", &status))?,
        progress: u8::try_from(progress.clamp(0, 100)).unwrap_or(100),
        result_location: row.try_get("result_location").map_err(db_error)?,
        error: row.try_get("error").map_err(db_error)?,
        created_at: row.try_get("created_at").map_err(db_error)?,
        updated_at: row.try_get("updated_at").map_err(db_error)?,
        expires_at: row.try_get("expires_at").map_err(db_error)?,
    })
}
