//! Async report jobs: `POST /reports` answers `202` with a job, a worker
//! builds the report, `GET /jobs/{id}` answers `303` to the result.
//!
//! The job row and its `job.requested.v1` event commit together (keel-http
//! jobs); the worker is a consumer group on the jobs topic. It only queues
//! the work from inside the consumer's transaction: the report is written
//! after that transaction commits, because SQLite has one writer and the
//! transaction holds it.

use std::collections::HashMap;

use async_trait::async_trait;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use keel_http::jobs::{JobRequested, Jobs};
use keel_http::problem::Problem;
use keel_messaging::consumer::{DeliveryInfo, Handler, HandlerError};
use keel_store::envelope::Envelope;
use object_store::path::Path as ObjectPath;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::blobs::Blobs;
use crate::shop::ShopStore;

/// Finished reports, one object each (`reports/<job id>.json`) in the
/// blob store `--blobs` names: a local directory by default, an S3 bucket
/// when several processes serve one system, so that any of them answers
/// the `303` another's job pointed to, and a restart loses none. A sweep
/// deletes the reports of jobs retention has pruned. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reports {
    blobs: Blobs,
}

/// Where reports go in the blob store.
const PREFIX: &str = "reports";

impl Reports {
    /// Reports kept in `blobs`.
    pub fn new(blobs: Blobs) -> Self {
        Self { blobs }
    }

    /// Reports in memory, for tests and the demo.
    pub fn in_memory() -> Self {
        Self::new(Blobs::in_memory())
    }

    fn path(id: &str) -> Option<ObjectPath> {
        // A job id is a UUID; anything else names no report (and no path).
        let safe = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        safe.then(|| ObjectPath::from(format!("{PREFIX}/{id}.json")))
    }

    /// Stores `report`, durably before this returns (the job then points
    /// at it, so it must survive what the job row survives).
    pub async fn insert(&self, report: &Report) -> Result<(), object_store::Error> {
        let Some(path) = Self::path(&report.job_id) else {
            return Err(object_store::Error::InvalidPath {
                source: object_store::path::Error::EmptySegment {
                    path: report.job_id.clone(),
                },
            });
        };
        let bytes = serde_json::to_vec(report).unwrap_or_default();
        self.blobs.put(&path, bytes).await
    }

    /// The report of job `id`; `None` if there is none (or the store
    /// cannot be read: logged).
    pub async fn get(&self, id: &str) -> Option<Report> {
        let path = Self::path(id)?;
        let bytes = match self.blobs.store().get(&path).await {
            Ok(found) => found.bytes().await,
            Err(object_store::Error::NotFound { .. }) => return None,
            Err(e) => Err(e),
        };
        match bytes.map(|b| serde_json::from_slice(&b)) {
            Ok(Ok(report)) => Some(report),
            Ok(Err(error)) => {
                tracing::warn!(%error, report = id, "an unreadable report");
                None
            }
            Err(error) => {
                tracing::warn!(%error, report = id, "the blob store cannot be read");
                None
            }
        }
    }

    /// Deletes the reports written before `cut_off` (their jobs are gone);
    /// returns how many.
    pub async fn sweep(
        &self,
        cut_off: chrono::DateTime<chrono::Utc>,
    ) -> Result<u64, object_store::Error> {
        use futures_util::TryStreamExt as _;

        let store = self.blobs.store();
        let mut listed = store.list(Some(&ObjectPath::from(PREFIX)));
        let mut swept = 0;
        while let Some(object) = listed.try_next().await? {
            if object.last_modified >= cut_off {
                continue;
            }
            match store.delete(&object.location).await {
                Ok(()) => swept += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(swept)
    }
}

/// A report: orders by status at the time it ran.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
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
        // Stored before the job says where: a 303 never points at nothing.
        reports.insert(&report).await.map_err(|e| {
            keel_http::jobs::JobError::from(keel_store::StoreError::other(format!(
                "the report could not be stored: {e}"
            )))
        })?;
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
    match reports.get(&id).await {
        Some(report) => Json(report).into_response(),
        None => Problem::not_found(format!(
            "no finished report {id} (reports go with their jobs)"
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

    fn report(id: &str) -> Report {
        Report {
            job_id: id.to_owned(),
            orders_by_status: HashMap::from([("completed".to_owned(), 3)]),
            generated_at: String::new(),
        }
    }

    #[tokio::test]
    async fn reports_come_back_and_the_sweep_takes_the_old_ones() {
        let reports = Reports::in_memory();
        reports.insert(&report("job-1")).await.unwrap();
        let got = reports.get("job-1").await.unwrap();
        assert_eq!(got.orders_by_status["completed"], 3);
        assert!(reports.get("job-2").await.is_none());
        let before = keel_core::clock::utc_now() - chrono::Duration::hours(1);
        assert_eq!(reports.sweep(before).await.unwrap(), 0);
        let after = keel_core::clock::utc_now() + chrono::Duration::seconds(1);
        assert_eq!(reports.sweep(after).await.unwrap(), 1);
        assert!(reports.get("job-1").await.is_none());
    }

    #[tokio::test]
    async fn an_id_that_is_no_job_id_names_no_path() {
        let reports = Reports::in_memory();
        for id in ["../x", "a/b", "", "job 1"] {
            assert!(reports.get(id).await.is_none(), "{id}");
            assert!(reports.insert(&report(id)).await.is_err(), "{id}");
        }
    }
}
