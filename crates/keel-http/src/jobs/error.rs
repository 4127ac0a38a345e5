//! What can go wrong with a job, and the HTTP answer to each.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_core::{Classify, ErrorClass};
use keel_messaging::outbox::OutboxError;
use keel_store::JobStatus;
use keel_store::StoreError;

use crate::problem::Problem;

/// The longest idempotency key accepted, in characters (the
/// Idempotency-Key layer's limit: a key means the same on every route).
pub const MAX_KEY_LEN: usize = crate::idempotency::MAX_KEY_LEN;

/// A job operation failed. Each variant says what happened and what to do;
/// as a response each is an `application/problem+json` with its status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// `400`: starting a job needs an `Idempotency-Key` header.
    #[error(
        "starting a job requires an Idempotency-Key header: generate one key (a UUID) per job \
         and send the same key when retrying, so the retry returns the same job"
    )]
    MissingKey,
    /// `400`: the `Idempotency-Key` header is malformed or too long.
    #[error("{0}")]
    InvalidKey(String),
    /// `400`: the body is not a JSON object.
    #[error("invalid job parameters: {0}")]
    InvalidParams(String),
    /// `413`: the body is over the limit.
    #[error("job parameters are larger than the {limit}-byte limit")]
    ParamsTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// `422`: the key was used before to start a job with other parameters.
    #[error(
        "this Idempotency-Key already started job {job_id} with different parameters; use a new \
         key for a new job"
    )]
    KeyReused {
        /// The job the key started.
        job_id: String,
    },
    /// `404`: no such job (never created, or pruned).
    #[error("job {id} not found")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    /// `410`: the job expired; its result is no longer kept.
    #[error("job {id} expired; its result is no longer available, start a new job")]
    Expired {
        /// The job's id.
        id: String,
    },
    /// `409`: the job already finished (or was cancelled), so it cannot be
    /// cancelled or updated. A worker getting this should stop working on
    /// the job.
    #[error("job {id} is already {}; it cannot change any more", status.as_str())]
    AlreadyFinal {
        /// The job's id.
        id: String,
        /// Its final status.
        status: JobStatus,
    },
    /// `503`: the store failed transiently; nothing changed, retry.
    /// `500` for other store failures.
    #[error("job store failed: {0}")]
    Store(#[from] StoreError),
    /// `500`: the job's event could not be written (an invalid event).
    #[error("job event refused by the outbox: {0}")]
    Outbox(#[source] OutboxError),
}

impl From<OutboxError> for JobError {
    fn from(err: OutboxError) -> Self {
        match err {
            OutboxError::Store(store) => Self::Store(store),
            other => Self::Outbox(other),
        }
    }
}

impl Classify for JobError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(err) => err.class(),
            Self::Outbox(err) => err.class(),
            _ => ErrorClass::Permanent,
        }
    }
}

impl JobError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey(_) | Self::InvalidParams(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::ParamsTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::KeyReused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Expired { .. } => StatusCode::GONE,
            Self::AlreadyFinal { .. } => StatusCode::CONFLICT,
            Self::Store(err) => Problem::store_status(err),
            Self::Outbox(err) => Problem::outbox_status(err),
        }
    }

    /// A short name for metrics and the problem type.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey(_) => "invalid-key",
            Self::InvalidParams(_) => "invalid-params",
            Self::ParamsTooLarge { .. } => "params-too-large",
            Self::KeyReused { .. } => "key-reused",
            Self::NotFound { .. } => "not-found",
            Self::Expired { .. } => "expired",
            Self::AlreadyFinal { .. } => "already-final",
            Self::Store(_) => "store",
            Self::Outbox(_) => "outbox",
        }
    }
}

impl IntoResponse for JobError {
    fn into_response(self) -> Response {
        let status = self.status();
        metrics::counter!("keel_jobs_refused_total", "reason" => self.kind()).increment(1);
        if status.is_server_error() {
            tracing::warn!(error = %self, "job request failed");
        } else {
            tracing::debug!(reason = self.kind(), error = %self, "job request refused");
        }
        match &self {
            Self::Store(err) => Problem::from_store(err),
            Self::Outbox(err) => Problem::from_outbox(err),
            _ => Problem::new(status, self.to_string()).typed(&format!("jobs:{}", self.kind())),
        }
        .into_response()
    }
}
