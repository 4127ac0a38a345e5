//! Asynchronous jobs: the storage behind `keel-http`'s `202 Accepted` +
//! `/jobs/{id}` pattern.
//!
//! A retried `POST` must return the *same* job, not start a second one. The
//! `UNIQUE (kind, idempotency_key)` constraint settles it: creation is
//! `INSERT ... ON CONFLICT DO NOTHING` followed by reading the row back in
//! the same transaction, so whichever request came second gets the first
//! one's job (and, since nothing was inserted, writes no outbox event). On
//! PostgreSQL a concurrent creator with the same key waits for the first
//! one's transaction and then reads its job (a fresh snapshot per statement
//! in `READ COMMITTED`); SQLite's single writer orders them outright.
//!
//! Updates are one conditional `UPDATE ... WHERE status IN ('queued',
//! 'running')`, so "refuse to leave a final state" cannot race: a client's
//! cancel and a worker's success are ordered by the database, and the
//! loser is told.

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{JobRecord, JobStatus};

use crate::backend::{SqlBackend, Tx, refused_or_missing};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::corrupt;
use crate::retry::{bounded_delete_sql, delete_batch, write};

const COLUMNS: &str = "id, kind, idempotency_key, params, status, progress, result_location, \
                       error, created_at, updated_at, expires_at";

const INSERT_SQL: &str = "\
INSERT INTO keel_jobs (id, kind, idempotency_key, params, status, progress, result_location,
                       error, created_at, updated_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (kind, idempotency_key) DO NOTHING";

const UPDATE_SQL: &str = "\
UPDATE keel_jobs
   SET status = $2, progress = $3, result_location = $4, error = $5, updated_at = $6,
       expires_at = $7
 WHERE id = $1 AND status IN ('queued', 'running')";

/// [`JobStore::job_create`](keel_store::JobStore::job_create).
pub async fn create<B: SqlBackend>(
    tx: &mut Tx<B>,
    job: &JobRecord,
) -> Result<JobRecord, StoreError> {
    let params = serde_json::to_string(&job.params).map_err(StoreError::other)?;
    let insert = [
        job.id.as_str().into(),
        job.kind.as_str().into(),
        job.idempotency_key.as_str().into(),
        Value::Json(&params),
        job.status.as_str().into(),
        i64::from(job.progress.min(100)).into(),
        job.result_location.as_deref().into(),
        job.error.as_deref().into(),
        job.created_at.into(),
        job.updated_at.into(),
        job.expires_at.into(),
    ];
    B::Dialect::execute(Exec::Tx(&mut *tx), INSERT_SQL, &insert).await?;
    let sql = format!("SELECT {COLUMNS} FROM keel_jobs WHERE kind = $1 AND idempotency_key = $2");
    let key = [
        job.kind.as_str().into(),
        job.idempotency_key.as_str().into(),
    ];
    let row = B::Dialect::fetch_optional(Exec::Tx(tx), &sql, &key)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("job {:?} after creating it", job.id)))?;
    job_from_row::<B::Dialect>(&row)
}

/// [`JobStore::job_get`](keel_store::JobStore::job_get).
pub async fn get<B: SqlBackend>(store: &B, id: &str) -> Result<Option<JobRecord>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM keel_jobs WHERE id = $1");
    let row = store.read_optional(&sql, &[id.into()]).await?;
    row.as_ref().map(job_from_row::<B::Dialect>).transpose()
}

/// [`JobStore::job_update`](keel_store::JobStore::job_update).
pub async fn update<B: SqlBackend>(store: &B, job: &JobRecord) -> Result<bool, StoreError> {
    let params = [
        job.id.as_str().into(),
        job.status.as_str().into(),
        i64::from(job.progress.min(100)).into(),
        job.result_location.as_deref().into(),
        job.error.as_deref().into(),
        B::Dialect::now().into(),
        job.expires_at.into(),
    ];
    if write(store, "job_update", UPDATE_SQL, &params).await? == 1 {
        return Ok(true);
    }
    let id = job.id.as_str().into();
    refused_or_missing::<B::Dialect>(Exec::Pool(store.writer()), "keel_jobs", id, || {
        format!("job {:?}", job.id)
    })
    .await
}

/// [`JobStore::job_prune`](keel_store::JobStore::job_prune).
pub async fn prune<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = bounded_delete_sql::<B::Dialect>("keel_jobs", "id", "expires_at < $1", "expires_at");
    delete_batch(store, "job_prune", &sql, before.into(), batch).await
}

fn job_from_row<D: Dialect>(row: &D::Row) -> Result<JobRecord, StoreError> {
    let status = row.text("status")?;
    let params = row.json("params")?;
    Ok(JobRecord {
        id: row.text("id")?,
        kind: row.text("kind")?,
        idempotency_key: row.text("idempotency_key")?,
        params: serde_json::from_str(&params).map_err(|e| corrupt(D::NAME, "job params", e))?,
        status: JobStatus::parse(&status).ok_or_else(|| corrupt(D::NAME, "job status", &status))?,
        progress: u8::try_from(row.int("progress")?.clamp(0, 100)).unwrap_or(100),
        result_location: row.text_opt("result_location")?,
        error: row.text_opt("error")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        expires_at: row.time("expires_at")?,
    })
}

/// Implements [`JobStore`](keel_store::JobStore) for a
/// [`SqlBackend`] whose transaction is the core's [`Tx`].
#[macro_export]
macro_rules! job_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::JobStore for $store {
            async fn job_create(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                job: &$crate::__private::store::JobRecord,
            ) -> ::std::result::Result<
                $crate::__private::store::JobRecord,
                $crate::__private::StoreError,
            > {
                $crate::jobs::create::<Self>(tx, job).await
            }

            async fn job_get(
                &self,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::JobRecord>,
                $crate::__private::StoreError,
            > {
                $crate::jobs::get(self, id).await
            }

            async fn job_update(
                &self,
                job: &$crate::__private::store::JobRecord,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::jobs::update(self, job).await
            }

            async fn job_prune(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::jobs::prune(self, before, batch).await
            }
        }
    };
}
