//! Asynchronous jobs: their state, result and expiry.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};

/// The state of an asynchronous job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Accepted, waiting for a worker.
    Queued,
    /// A worker is on it.
    Running,
    /// Done; the result is at `result_location`.
    Succeeded,
    /// Failed; see `error`.
    Failed,
    /// Cancelled by the client.
    Cancelled,
}

impl JobStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }

    /// Whether the job has finished for good (succeeded, failed or
    /// cancelled): no update moves it again.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// An asynchronous job (202 Accepted, then poll).
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// The job id.
    pub id: String,
    /// What kind of job (`report`).
    pub kind: String,
    /// The idempotency key it was created with (unique per kind).
    pub idempotency_key: String,
    /// The job's parameters.
    pub params: serde_json::Value,
    /// Where it is.
    pub status: JobStatus,
    /// 0 to 100.
    pub progress: u8,
    /// Where the result lives once succeeded (for the 303).
    pub result_location: Option<String>,
    /// What went wrong, once failed.
    pub error: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// After this the job is gone (410).
    pub expires_at: DateTime<Utc>,
}

/// Asynchronous jobs.
#[async_trait]
pub trait JobStore: Store {
    /// Creates a job inside the caller's transaction (with its outbox event).
    /// If a job with the same kind and idempotency key exists, returns it
    /// instead and creates nothing.
    async fn job_create(&self, tx: &mut Self::Tx, job: &JobRecord)
    -> Result<JobRecord, StoreError>;

    /// One job.
    async fn job_get(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Updates status, progress, result, error and `expires_at` (and sets
    /// `updated_at` to now).
    /// Refuses (false) to move a job out of a final state (succeeded,
    /// failed, cancelled): the check and the write are one atomic step, so a
    /// client's cancel and a worker's success cannot both win.
    /// [`StoreError::NotFound`] if there is no such job.
    async fn job_update(&self, job: &JobRecord) -> Result<bool, StoreError>;

    /// Deletes up to `batch` jobs whose `expires_at` is before `before`;
    /// returns how many. Keep expired jobs for a while before pruning them
    /// (pass a time well before now): until then they answer `410 Gone`,
    /// afterwards only `404`.
    async fn job_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}
