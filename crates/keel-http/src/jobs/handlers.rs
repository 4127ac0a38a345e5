//! The HTTP side of [`Jobs`]: `POST` → `202`, `GET` status, `DELETE` cancel.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use chrono::{DateTime, Utc};
use keel_store::{JobRecord, JobStatus, JobStore, OutboxStore};
use serde::{Deserialize, Serialize};

use super::component::{Cancelled, Jobs};
use super::error::JobError;
use crate::body::BodyError;

/// The longest job id looked up; longer ones are `404` without a query.
const MAX_ID_LEN: usize = 128;

/// What the status URL (and the `202`) says about a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    /// The job's id.
    pub job_id: String,
    /// The job's kind.
    pub kind: String,
    /// Where it is.
    pub status: JobStatus,
    /// 0 to 100.
    pub progress: u8,
    /// Why it failed (`null` unless failed).
    pub error: Option<String>,
    /// Where the result is, once succeeded.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub result_location: Option<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it expires (then `410 Gone`).
    pub expires_at: DateTime<Utc>,
}

impl From<&JobRecord> for JobView {
    fn from(job: &JobRecord) -> Self {
        Self {
            job_id: job.id.clone(),
            kind: job.kind.clone(),
            status: job.status,
            progress: job.progress,
            error: job.error.clone(),
            result_location: job.result_location.clone(),
            created_at: job.created_at,
            updated_at: job.updated_at,
            expires_at: job.expires_at,
        }
    }
}

impl<S: JobStore + OutboxStore> Jobs<S> {
    /// `GET` and `DELETE` on `{base_path}/{id}`, ready to merge into your
    /// router. They serve jobs of every kind in the store, so with several
    /// kinds on one base path merge the routes of only one of them (axum
    /// refuses a route registered twice).
    pub fn routes(&self) -> Router {
        Router::new()
            .route(
                &format!("{}/{{id}}", self.options().base_path),
                get(status_handler::<S>).delete(cancel_handler::<S>),
            )
            .with_state(self.clone())
    }

    /// The `POST` handler that starts jobs of this kind, to mount at your
    /// own path: `.route("/reports", jobs.create_route())`. The body is the
    /// job's JSON parameters; `Idempotency-Key` is required.
    pub fn create_route<St: Clone + Send + Sync + 'static>(&self) -> MethodRouter<St> {
        post(create_handler::<S>).with_state(self.clone())
    }

    /// The `202 Accepted` for a job: `Location` (the status URL),
    /// `Retry-After`, and the job in the body. For your own `POST` handler
    /// if [`create_route`](Self::create_route) does not fit.
    pub fn accepted(&self, job: &JobRecord) -> Response {
        let mut response = (StatusCode::ACCEPTED, axum::Json(JobView::from(job))).into_response();
        let headers = response.headers_mut();
        set_location(headers, &self.status_url(&job.id));
        set_retry_after(headers, self.options().accepted_retry_after);
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }

    /// The answer of the status URL for `job`: `303` to the result once
    /// succeeded; otherwise `200` with the job (and its error, once failed:
    /// a failed job is still a successful status request), plus
    /// `Retry-After` while it is queued or running.
    pub fn status_response(&self, job: &JobRecord) -> Response {
        if let (JobStatus::Succeeded, Some(location)) = (job.status, &job.result_location) {
            let mut response = StatusCode::SEE_OTHER.into_response();
            set_location(response.headers_mut(), location);
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            return response;
        }
        let mut response = (StatusCode::OK, axum::Json(JobView::from(job))).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if matches!(job.status, JobStatus::Queued | JobStatus::Running) {
            set_retry_after(headers, self.options().poll_retry_after);
        }
        response
    }
}

async fn create_handler<S: JobStore + OutboxStore>(
    State(jobs): State<Jobs<S>>,
    request: axum::http::Request<Body>,
) -> Response {
    let (parts, body) = request.into_parts();
    match create(&jobs, &parts, body).await {
        Ok(job) => jobs.accepted(&job),
        Err(err) => err.into_response(),
    }
}

async fn create<S: JobStore + OutboxStore>(
    jobs: &Jobs<S>,
    parts: &Parts,
    body: Body,
) -> Result<JobRecord, JobError> {
    let key = parse_key(&parts.headers)?;
    let bytes = read_body(parts, body, jobs.options().max_params).await?;
    let params = if bytes.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(|e| JobError::InvalidParams(e.to_string()))?
    };
    // No body, or `null`: no parameters.
    let params = match params {
        serde_json::Value::Null => serde_json::Value::Object(serde_json::Map::new()),
        object @ serde_json::Value::Object(_) => object,
        _ => {
            return Err(JobError::InvalidParams(
                "the parameters must be a JSON object".to_owned(),
            ));
        }
    };
    let principal = (jobs.options().principal)(parts);
    Ok(jobs.create(&principal, &key, params).await?.job)
}

async fn status_handler<S: JobStore + OutboxStore>(
    State(jobs): State<Jobs<S>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match job_id(id) {
        Ok(id) => id,
        Err(err) => return err.into_response(),
    };
    match jobs.get(&id).await {
        Ok(job) => jobs.status_response(&job),
        Err(err) => err.into_response(),
    }
}

async fn cancel_handler<S: JobStore + OutboxStore>(
    State(jobs): State<Jobs<S>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match job_id(id) {
        Ok(id) => id,
        Err(err) => return err.into_response(),
    };
    let outcome = match jobs.cancel(&id).await {
        Ok(outcome) => outcome,
        Err(err) => return err.into_response(),
    };
    let status = match outcome {
        // Still winding down in its worker: accepted, not yet done.
        Cancelled::Running => StatusCode::ACCEPTED,
        Cancelled::Queued | Cancelled::Already => StatusCode::OK,
    };
    match jobs.get(&id).await {
        Ok(job) => {
            let mut response = (status, axum::Json(JobView::from(&job))).into_response();
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        Err(err) => err.into_response(),
    }
}

fn job_id(id: Result<Path<String>, PathRejection>) -> Result<String, JobError> {
    match id {
        Ok(Path(id)) if !id.is_empty() && id.len() <= MAX_ID_LEN => Ok(id),
        Ok(Path(id)) => Err(JobError::NotFound {
            id: id.chars().take(MAX_ID_LEN).collect(),
        }),
        Err(_) => Err(JobError::NotFound {
            id: "(undecodable)".to_owned(),
        }),
    }
}

/// The `Idempotency-Key`, read exactly as the Idempotency-Key layer reads
/// it, so one key means the same on every route.
fn parse_key(headers: &HeaderMap) -> Result<String, JobError> {
    match crate::idempotency::parse_key(headers) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(JobError::MissingKey),
        Err(rejection) => Err(JobError::InvalidKey(rejection.to_string())),
    }
}

async fn read_body(parts: &Parts, body: Body, limit: usize) -> Result<Bytes, JobError> {
    crate::body::read_limited(&parts.headers, body, limit)
        .await
        .map_err(|err| match err {
            BodyError::TooLarge { limit } => JobError::ParamsTooLarge { limit },
            unreadable @ BodyError::Unreadable(_) => {
                JobError::InvalidParams(unreadable.to_string())
            }
        })
}

fn set_location(headers: &mut HeaderMap, location: &str) {
    match HeaderValue::from_str(location) {
        Ok(value) => {
            headers.insert(header::LOCATION, value);
        }
        Err(_) => tracing::warn!(location, "job location is not a valid header value"),
    }
}

fn set_retry_after(headers: &mut HeaderMap, after: std::time::Duration) {
    // Round up: "retry in 0 s" would invite a busy loop.
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
}
