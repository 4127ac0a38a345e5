//! Async report jobs: `POST /reports` answers `202` with a job, a worker
//! builds the report, `GET /jobs/{id}` answers `303` to the result.
//!
//! The job row and its `job.requested.v1` event commit together (keel-http
//! jobs); the worker is a consumer group on the jobs topic. It only queues
//! the work from inside the consumer's transaction: the report is written
//! after that transaction commits, because SQLite has one writer and the
//! transaction holds it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use keel_http::jobs::{JobRequested, Jobs};
use keel_http::problem::Problem;
use keel_messaging::consumer::{DeliveryInfo, Handler, HandlerError};
use keel_store::envelope::Envelope;
use parking_lot::Mutex;
use serde::Serialize;
use utoipa::ToSchema;

use crate::shop::ShopStore;

/// How many finished reports are kept: the latest 1,000. Anyone may ask
/// for a report, so the memory they take must have a bound.
pub const MAX_REPORTS: usize = 1000;

/// Finished reports, by job id: the latest [`MAX_REPORTS`], the oldest
/// forgotten first. Cheap to clone; clones share the reports.
#[derive(Debug, Clone, Default)]
pub struct Reports {
    kept: Arc<Mutex<Kept>>,
}

/// The reports by id, and their ids oldest first.
type Kept = (HashMap<String, Report>, VecDeque<String>);

impl Reports {
    /// Keeps `report`, forgetting the oldest past [`MAX_REPORTS`].
    pub fn insert(&self, report: Report) {
        let mut kept = self.kept.lock();
        let (by_id, order) = &mut *kept;
        if by_id
            .insert(report.job_id.clone(), report.clone())
            .is_none()
        {
            order.push_back(report.job_id);
        }
        while order.len() > MAX_REPORTS {
            if let Some(oldest) = order.pop_front() {
                by_id.remove(&oldest);
            }
        }
    }

    /// The report of job `id`, if kept.
    pub fn get(&self, id: &str) -> Option<Report> {
        self.kept.lock().0.get(id).cloned()
    }

    /// How many are kept.
    pub fn len(&self) -> usize {
        self.kept.lock().1.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A report: orders by status at the time it ran.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The job that built it.
    pub job_id: String,
    /// Orders counted by status.
    pub orders_by_status: HashMap<String, u64>,
    /// When it was built (RFC 3339).
    pub generated_at: String,
}

/// Builds reports for `job.requested.v1`.
pub struct ReportWorker<S: ShopStore> {
    /// The jobs component (status updates).
    pub jobs: Jobs<S>,
    /// Where finished reports go.
    pub reports: Reports,
}

async fn build<S: ShopStore>(jobs: Jobs<S>, reports: Reports, id: String) {
    let run = async {
        jobs.start(&id).await?;
        let counts = jobs
            .store()
            .order_counts()
            .await
            .map_err(keel_http::jobs::JobError::from)?;
        let report = Report {
            job_id: id.clone(),
            orders_by_status: counts
                .into_iter()
                .map(|(s, n)| (s.as_str().to_owned(), n))
                .collect(),
            generated_at: crate::shop::db::now_rfc3339(),
        };
        reports.insert(report);
        jobs.succeed(&id, &format!("/reports/{id}")).await?;
        Ok::<(), keel_http::jobs::JobError>(())
    };
    if let Err(e) = run.await {
        tracing::warn!(job = %id, error = %e, "report job failed");
        let _ = jobs.fail(&id, &e.to_string()).await;
    }
}

#[async_trait]
impl<S: ShopStore> Handler<S::Tx> for ReportWorker<S> {
    async fn handle(
        &self,
        _tx: &mut S::Tx,
        envelope: &Envelope,
        _info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let requested: JobRequested = envelope.data_as()?;
        tokio::spawn(build(
            self.jobs.clone(),
            self.reports.clone(),
            requested.job_id,
        ));
        Ok(())
    }
}

/// `GET /reports/{id}`: a finished report.
#[utoipa::path(get, path = "/reports/{id}",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "The report", body = Report),
        (status = 404, description = "No finished report with this id"),
    ), tag = "reports")]
pub async fn get_report(State(reports): State<Reports>, Path(id): Path<String>) -> Response {
    match reports.get(&id) {
        Some(report) => Json(report).into_response(),
        None => Problem::not_found(format!(
            "no finished report {id} (the latest {MAX_REPORTS} are kept)"
        ))
        .into_response(),
    }
}

/// Documents `POST /reports` (served by keel-http jobs).
#[utoipa::path(post, path = "/reports",
    params(("Idempotency-Key" = String, Header, description = "Required")),
    request_body(content = Option<Object>, description = "Report parameters (a JSON object; none, or `null`, is `{}`)", content_type = "application/json"),
    responses(
        (status = 202, description = "Accepted; Location is the job's status URL"),
        (status = 400, description = "No or bad Idempotency-Key, malformed JSON"),
        (status = 410, description = "The key's job expired; use a new key"),
        (status = 413, description = "Parameters larger than 64 KiB"),
        (status = 422, description = "The key was used with other parameters"),
    ), tag = "reports")]
pub fn doc_create_report() {}

/// Documents `GET /jobs/{id}` (served by keel-http jobs).
#[utoipa::path(get, path = "/jobs/{id}",
    params(("id" = String, Path, description = "The job id (ids longer than 128 characters are unknown)")),
    responses(
        (status = 200, description = "Queued, running or failed: status and progress"),
        (status = 303, description = "Succeeded: Location is the result"),
        (status = 404, description = "Unknown job"),
        (status = 410, description = "Expired"),
    ), tag = "reports")]
pub fn doc_job_status() {}

/// Documents `DELETE /jobs/{id}` (served by keel-http jobs).
#[utoipa::path(delete, path = "/jobs/{id}",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "Cancelled while queued, or cancelled before (a retried DELETE succeeds)"),
        (status = 202, description = "Cancelled while running: its worker stops at its next update"),
        (status = 404, description = "Unknown job"),
        (status = 409, description = "It already succeeded or failed"),
        (status = 410, description = "Expired"),
    ), tag = "reports")]
pub fn doc_cancel_job() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_latest_reports_are_kept() {
        let reports = Reports::default();
        for i in 0..MAX_REPORTS + 5 {
            reports.insert(Report {
                job_id: format!("job-{i}"),
                orders_by_status: HashMap::new(),
                generated_at: String::new(),
            });
        }
        assert_eq!(reports.len(), MAX_REPORTS);
        assert!(reports.get("job-0").is_none(), "the oldest went first");
        assert!(reports.get(&format!("job-{}", MAX_REPORTS + 4)).is_some());
    }
}
