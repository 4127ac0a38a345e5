//! [`Jobs`]: create, read, cancel and work on jobs.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use keel_messaging::outbox::Outbox;
use keel_store::envelope::{Event, EventMeta};
use keel_store::{JobRecord, JobStatus, JobStore, OutboxStore};
use serde::{Deserialize, Serialize};

use super::error::JobError;
use super::options::{InvalidJobsOptions, JobsOptions};

/// The event written to the outbox, in the job's creating transaction, for
/// workers to pick up: CloudEvents type `job.requested.v1`, subject (and
/// partition key) the job id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobRequested {
    /// The job's id.
    pub job_id: String,
    /// The job's kind (`report`).
    pub kind: String,
    /// The job's parameters, as posted.
    pub params: serde_json::Value,
}

impl Event for JobRequested {
    const TYPE: &'static str = "job.requested.v1";

    fn subject(&self) -> String {
        self.job_id.clone()
    }
}

/// A job creation's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    /// The job: the new one, or the one the key started before.
    pub job: JobRecord,
    /// Whether this call created it (false: a retry with the same key).
    pub new: bool,
}

/// A cancellation's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// The job was queued: it is cancelled and will never run.
    Queued,
    /// The job was running: it is marked cancelled; its worker stops at its
    /// next update (which fails with [`JobError::AlreadyFinal`]).
    Running,
    /// It was cancelled before (a repeated `DELETE`).
    Already,
}

/// Asynchronous jobs of one kind: `POST` answers `202 Accepted` at once, a
/// worker does the work, the client polls the status URL.
///
/// The job row and its `job.requested.v1` event are written in one
/// transaction through the [`Outbox`], so a job exists if and only if its
/// event will be published. Cheap to clone.
pub struct Jobs<S> {
    outbox: Outbox<S>,
    options: Arc<JobsOptions>,
}

impl<S: Clone> Clone for Jobs<S> {
    fn clone(&self) -> Self {
        Self {
            outbox: self.outbox.clone(),
            options: Arc::clone(&self.options),
        }
    }
}

impl<S> std::fmt::Debug for Jobs<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: JobStore + OutboxStore> Jobs<S> {
    /// Jobs with `options`, writing events through `outbox` (pass the one
    /// your relay uses, so a new job wakes it at once).
    pub fn new(outbox: Outbox<S>, options: JobsOptions) -> Result<Self, InvalidJobsOptions> {
        options.validate()?;
        Ok(Self {
            outbox,
            options: Arc::new(options),
        })
    }

    /// The options.
    pub fn options(&self) -> &JobsOptions {
        &self.options
    }

    /// The store.
    pub fn store(&self) -> &S {
        self.outbox.store()
    }

    /// The status URL of job `id`: `{base_path}/{id}`.
    pub fn status_url(&self, id: &str) -> String {
        format!("{}/{id}", self.options.base_path)
    }

    /// Starts a job with `params` for `principal`'s idempotency `key`, or
    /// returns the job that key started before. The row and its event
    /// commit together; concurrent retries are settled by the store's
    /// unique `(kind, key)` constraint. [`JobError::KeyReused`] if the key
    /// started a job with other parameters, [`JobError::Expired`] if the
    /// job it started has expired (start a new one with a new key).
    pub async fn create(
        &self,
        principal: &str,
        key: &str,
        params: serde_json::Value,
    ) -> Result<Created, JobError> {
        let now = now();
        let job = JobRecord {
            id: keel_core::id::new_id().to_string(),
            kind: self.options.kind.clone(),
            idempotency_key: scoped_key(principal, key),
            params,
            status: JobStatus::Queued,
            progress: 0,
            result_location: None,
            error: None,
            created_at: now,
            updated_at: now,
            expires_at: self.expiry(now),
        };
        let store = self.outbox.store();
        let mut tx = store.begin().await?;
        let stored = store.job_create(&mut tx, &job).await?;
        if stored.id != job.id {
            store.rollback(tx).await?;
            if stored.params != job.params {
                return Err(JobError::KeyReused { job_id: stored.id });
            }
            if stored.expires_at <= now {
                // The key's job is gone; the key stays taken until pruned.
                return Err(JobError::Expired { id: stored.id });
            }
            metrics::counter!("keel_jobs_deduplicated_total", "kind" => self.options.kind.clone())
                .increment(1);
            tracing::debug!(job_id = %stored.id, "job creation retried; same job returned");
            return Ok(Created {
                job: stored,
                new: false,
            });
        }
        let event = JobRequested {
            job_id: job.id.clone(),
            kind: job.kind.clone(),
            params: job.params.clone(),
        };
        self.outbox
            .append_event(
                &mut tx,
                &self.options.topic,
                &self.options.source,
                &event,
                EventMeta {
                    occurred_at: now,
                    version: 1,
                },
            )
            .await?;
        self.outbox.commit(tx).await?;
        metrics::counter!("keel_jobs_created_total", "kind" => self.options.kind.clone())
            .increment(1);
        tracing::info!(job_id = %job.id, kind = %job.kind, "job accepted");
        Ok(Created { job, new: true })
    }

    /// The job `id` (of any kind: status URLs are shared):
    /// [`JobError::NotFound`] if there is none, [`JobError::Expired`] once
    /// it expired.
    pub async fn get(&self, id: &str) -> Result<JobRecord, JobError> {
        let job = self
            .outbox
            .store()
            .job_get(id)
            .await?
            .ok_or_else(|| JobError::NotFound { id: id.to_owned() })?;
        if job.expires_at <= now() {
            return Err(JobError::Expired { id: job.id });
        }
        Ok(job)
    }

    /// Cancels job `id`. [`JobError::AlreadyFinal`] if it already succeeded
    /// or failed; a job cancelled before is [`Cancelled::Already`].
    pub async fn cancel(&self, id: &str) -> Result<Cancelled, JobError> {
        let job = self.get(id).await?;
        let was = job.status;
        match self.transition(job, JobStatus::Cancelled, |_| {}).await {
            Ok(_) => {
                metrics::counter!("keel_jobs_cancelled_total", "kind" => self.options.kind.clone())
                    .increment(1);
                tracing::info!(job_id = id, "job cancelled");
                Ok(if was == JobStatus::Running {
                    Cancelled::Running
                } else {
                    Cancelled::Queued
                })
            }
            Err(JobError::AlreadyFinal {
                status: JobStatus::Cancelled,
                ..
            }) => Ok(Cancelled::Already),
            Err(err) => Err(err),
        }
    }

    /// Worker: marks the job running (progress unchanged).
    /// [`JobError::AlreadyFinal`] if it was cancelled: stop working on it.
    pub async fn start(&self, id: &str) -> Result<JobRecord, JobError> {
        let job = self.get(id).await?;
        self.transition(job, JobStatus::Running, |_| {}).await
    }

    /// Worker: reports progress (0 to 100, clamped); the job is running.
    /// [`JobError::AlreadyFinal`] if it was cancelled: stop working on it.
    pub async fn progress(&self, id: &str, percent: u8) -> Result<JobRecord, JobError> {
        let job = self.get(id).await?;
        self.transition(job, JobStatus::Running, |job| {
            job.progress = percent.min(100)
        })
        .await
    }

    /// Worker: the job succeeded and its result is at `result_location`
    /// (where `GET` on the status URL redirects with `303`).
    pub async fn succeed(&self, id: &str, result_location: &str) -> Result<JobRecord, JobError> {
        let job = self.get(id).await?;
        let location = result_location.to_owned();
        self.transition(job, JobStatus::Succeeded, move |job| {
            job.progress = 100;
            job.result_location = Some(location);
        })
        .await
    }

    /// Worker: the job failed for good with `error` (shown to the client in
    /// the status body; keep internals out of it).
    pub async fn fail(&self, id: &str, error: &str) -> Result<JobRecord, JobError> {
        let job = self.get(id).await?;
        let error = error.to_owned();
        self.transition(job, JobStatus::Failed, move |job| job.error = Some(error))
            .await
    }

    /// Deletes up to `batch` jobs that expired more than `grace` ago (until
    /// then they answer `410`, afterwards `404`); returns how many.
    pub async fn prune(&self, grace: std::time::Duration, batch: usize) -> Result<u64, JobError> {
        let now = now();
        let before = chrono::Duration::from_std(grace)
            .ok()
            .and_then(|grace| now.checked_sub_signed(grace))
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        let deleted = self.outbox.store().job_prune(before, batch).await?;
        if deleted > 0 {
            metrics::counter!("keel_jobs_pruned_total").increment(deleted);
        }
        Ok(deleted)
    }

    /// Moves `job` to `status` (after `change`), refusing to leave a final
    /// state; every change renews the job's expiry.
    async fn transition(
        &self,
        mut job: JobRecord,
        status: JobStatus,
        change: impl FnOnce(&mut JobRecord),
    ) -> Result<JobRecord, JobError> {
        if job.status.is_final() {
            return Err(JobError::AlreadyFinal {
                id: job.id,
                status: job.status,
            });
        }
        job.status = status;
        change(&mut job);
        let now = now();
        job.updated_at = now;
        job.expires_at = self.expiry(now);
        if self.outbox.store().job_update(&job).await? {
            return Ok(job);
        }
        // Someone else moved it to a final state first: say which.
        let current = self.get(&job.id).await?;
        Err(JobError::AlreadyFinal {
            id: current.id,
            status: current.status,
        })
    }

    fn expiry(&self, from: DateTime<Utc>) -> DateTime<Utc> {
        chrono::Duration::from_std(self.options.ttl)
            .ok()
            .and_then(|ttl| from.checked_add_signed(ttl))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

/// The key as stored: scoped to the principal, length-prefixed so no two
/// (principal, key) pairs collide.
fn scoped_key(principal: &str, key: &str) -> String {
    format!("{}:{principal}:{key}", principal.len())
}

/// Now, by the wall clock read through `keel_core::clock`, in whole
/// milliseconds (what the stores keep).
fn now() -> DateTime<Utc> {
    let ms = i64::try_from(keel_core::clock::unix_millis()).unwrap_or(i64::MAX);
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}
