//! What a [`Jobs`](super::Jobs) component does, with documented defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};

/// How long a job is kept after its last change: 24 hours. After that its
/// status URL answers `410 Gone`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The `Retry-After` of `202 Accepted`: 5 seconds.
pub const DEFAULT_ACCEPTED_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The `Retry-After` of a status poll while the job is queued or running:
/// 10 seconds.
pub const DEFAULT_POLL_RETRY_AFTER: Duration = Duration::from_secs(10);

/// The largest `POST` body (the job's JSON parameters): 64 KiB.
pub const DEFAULT_MAX_PARAMS: usize = 64 * 1024;

/// The outbox topic of `job.requested.v1` events: `jobs`.
pub const DEFAULT_TOPIC: &str = "jobs";

/// The CloudEvents `source` of job events: `/keel/jobs`.
pub const DEFAULT_SOURCE: &str = "/keel/jobs";

/// The path status URLs live under: `/jobs` (so `/jobs/{id}`).
pub const DEFAULT_BASE_PATH: &str = "/jobs";

/// The principal of a request (whose idempotency keys are whose).
pub type JobPrincipalFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;

/// Options of a [`Jobs`](super::Jobs) component.
#[derive(Clone)]
pub struct JobsOptions {
    pub(crate) kind: String,
    pub(crate) base_path: String,
    pub(crate) topic: String,
    pub(crate) source: String,
    pub(crate) ttl: Duration,
    pub(crate) accepted_retry_after: Duration,
    pub(crate) poll_retry_after: Duration,
    pub(crate) max_params: usize,
    pub(crate) principal: JobPrincipalFn,
}

impl fmt::Debug for JobsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobsOptions")
            .field("kind", &self.kind)
            .field("base_path", &self.base_path)
            .field("topic", &self.topic)
            .field("source", &self.source)
            .field("ttl", &self.ttl)
            .field("accepted_retry_after", &self.accepted_retry_after)
            .field("poll_retry_after", &self.poll_retry_after)
            .field("max_params", &self.max_params)
            .finish_non_exhaustive()
    }
}

/// The default principal: a digest of the `Authorization` header, or
/// `anonymous` without one (the same rule as the Idempotency-Key layer's).
pub fn default_job_principal(parts: &Parts) -> String {
    match parts.headers.get(header::AUTHORIZATION) {
        Some(value) => {
            let digest = Sha256::digest(value.as_bytes());
            format!("authz:{}", hex::encode(&digest[..16]))
        }
        None => "anonymous".to_owned(),
    }
}

impl JobsOptions {
    /// Options for jobs of `kind` (e.g. `report`), with the defaults:
    /// status under `/jobs`, events on topic `jobs` from `/keel/jobs`, TTL
    /// 24 h, `Retry-After` 5 s on `202` and 10 s while polling, 64 KiB of
    /// parameters, [`default_job_principal`].
    pub fn new(kind: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            base_path: DEFAULT_BASE_PATH.to_owned(),
            topic: DEFAULT_TOPIC.to_owned(),
            source: DEFAULT_SOURCE.to_owned(),
            ttl: DEFAULT_TTL,
            accepted_retry_after: DEFAULT_ACCEPTED_RETRY_AFTER,
            poll_retry_after: DEFAULT_POLL_RETRY_AFTER,
            max_params: DEFAULT_MAX_PARAMS,
            principal: Arc::new(default_job_principal),
        }
    }

    /// The path status URLs live under (default `/jobs`): a job's status is
    /// at `{base_path}/{id}`, which is the `Location` of the `202`.
    pub fn base_path(mut self, path: impl Into<String>) -> Self {
        self.base_path = path.into();
        self
    }

    /// The outbox topic of the `job.requested.v1` event (default `jobs`).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// The CloudEvents `source` of the events (default `/keel/jobs`).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// How long a job is kept after its last change (default 24 h); then
    /// its status answers `410 Gone` until it is pruned.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The `Retry-After` of `202 Accepted` (default 5 s).
    pub fn accepted_retry_after(mut self, after: Duration) -> Self {
        self.accepted_retry_after = after;
        self
    }

    /// The `Retry-After` of a status poll while queued or running
    /// (default 10 s).
    pub fn poll_retry_after(mut self, after: Duration) -> Self {
        self.poll_retry_after = after;
        self
    }

    /// The largest `POST` body, in bytes (default 64 KiB); larger ones are
    /// refused with `413`.
    pub fn max_params(mut self, bytes: usize) -> Self {
        self.max_params = bytes;
        self
    }

    /// How to tell whose request it is: idempotency keys are scoped per
    /// principal (default [`default_job_principal`]).
    pub fn principal(
        mut self,
        principal: impl Fn(&Parts) -> String + Send + Sync + 'static,
    ) -> Self {
        self.principal = Arc::new(principal);
        self
    }

    /// Checks that the options can work.
    pub fn validate(&self) -> Result<(), InvalidJobsOptions> {
        if self.kind.is_empty() || self.kind.len() > 64 {
            return Err(InvalidJobsOptions::Kind(self.kind.clone()));
        }
        if !self.base_path.starts_with('/') || self.base_path.ends_with('/') {
            return Err(InvalidJobsOptions::BasePath(self.base_path.clone()));
        }
        if self.topic.is_empty() {
            return Err(InvalidJobsOptions::Topic);
        }
        if self.ttl.is_zero() {
            return Err(InvalidJobsOptions::ZeroTtl);
        }
        if self.max_params == 0 {
            return Err(InvalidJobsOptions::ZeroMaxParams);
        }
        Ok(())
    }
}

/// Options of a [`Jobs`](super::Jobs) component that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidJobsOptions {
    /// The kind is empty or longer than 64 characters.
    #[error("job kind {0:?} must be 1 to 64 characters")]
    Kind(String),
    /// The base path must start with `/` and not end with one.
    #[error("jobs base path {0:?} must start with `/` and not end with one (e.g. `/jobs`)")]
    BasePath(String),
    /// The topic is empty.
    #[error("the jobs outbox topic must not be empty")]
    Topic,
    /// A zero TTL would expire every job at once.
    #[error("the job TTL must be greater than zero")]
    ZeroTtl,
    /// A zero parameter limit would refuse every job.
    #[error("the job parameter limit must be at least one byte")]
    ZeroMaxParams,
}
