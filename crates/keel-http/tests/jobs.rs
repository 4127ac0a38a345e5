//! Async jobs over a real SQLite store: every status and header of `POST`,
//! `GET` and `DELETE`, idempotent creation (also when retries race), the job
//! row and its outbox event in one transaction, and the worker API.
#![cfg(feature = "jobs")]

use std::collections::HashSet;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use keel_http::jobs::{Cancelled, JobError, JobView, Jobs, JobsOptions};
use keel_http::problem::PROBLEM_JSON;
use keel_messaging::outbox::Outbox;
use keel_sqlite::SqliteStore;
use keel_store::envelope::Envelope;
use keel_store::{JobStatus, OutboxStore};
use tempfile::TempDir;
use tower::ServiceExt;

struct Fixture {
    store: SqliteStore,
    jobs: Jobs<SqliteStore>,
    app: Router,
    _dir: TempDir,
}

async fn fixture_with(options: JobsOptions, outbox_max: Option<usize>) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    let mut outbox = Outbox::new(store.clone());
    if let Some(max) = outbox_max {
        outbox = outbox.with_max_size(max);
    }
    let jobs = Jobs::new(outbox, options).expect("options");
    let app = Router::new()
        .route("/reports", jobs.create_route())
        .merge(jobs.routes());
    Fixture {
        store,
        jobs,
        app,
        _dir: dir,
    }
}

async fn fixture() -> Fixture {
    fixture_with(JobsOptions::new("report"), None).await
}

fn start(key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post("/reports").header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).expect("request")
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (parts.status, parts.headers, body)
}

async fn get(app: &Router, uri: &str) -> (StatusCode, HeaderMap, Bytes) {
    send(app, Request::get(uri).body(Body::empty()).expect("request")).await
}

async fn delete(app: &Router, uri: &str) -> (StatusCode, HeaderMap, Bytes) {
    send(
        app,
        Request::delete(uri).body(Body::empty()).expect("request"),
    )
    .await
}

fn view(body: &Bytes) -> JobView {
    serde_json::from_slice(body).expect("job json")
}

fn assert_problem(status: StatusCode, headers: &HeaderMap, body: &Bytes, expected: StatusCode) {
    assert_eq!(status, expected, "{}", String::from_utf8_lossy(body));
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let problem: serde_json::Value = serde_json::from_slice(body).expect("problem json");
    assert_eq!(problem["status"], expected.as_u16());
}

/// Starts a job through HTTP and returns its id.
async fn started(fx: &Fixture, key: &str) -> String {
    let (status, headers, body) = send(&fx.app, start(Some(key), r#"{"month":"2026-09"}"#)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let id = view(&body).job_id;
    assert_eq!(headers[header::LOCATION], format!("/jobs/{id}"));
    id
}

async fn outbox_events(store: &SqliteStore) -> Vec<Envelope> {
    store
        .outbox_claim("test", 100, Duration::from_secs(60))
        .await
        .expect("claim")
        .into_iter()
        .map(|pending| Envelope::from_json(&pending.record.payload).expect("envelope"))
        .collect()
}

#[tokio::test]
async fn post_answers_202_with_location_and_retry_after_and_writes_one_event() {
    let fx = fixture().await;
    let (status, headers, body) = send(&fx.app, start(Some("k-1"), r#"{"month":"2026-09"}"#)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let job = view(&body);
    assert_eq!(headers[header::LOCATION], format!("/jobs/{}", job.job_id));
    assert_eq!(headers[header::RETRY_AFTER], "5");
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(headers[header::CACHE_CONTROL], "no-store");
    assert_eq!(
        (job.status, job.progress, job.kind.as_str()),
        (JobStatus::Queued, 0, "report")
    );
    assert_eq!(job.error, None);

    let events = outbox_events(&fx.store).await;
    assert_eq!(events.len(), 1);
    let event = &events[0];
    assert_eq!(event.ty, "job.requested.v1");
    assert_eq!(event.subject.as_deref(), Some(job.job_id.as_str()));
    let data = event.data.as_ref().expect("data");
    assert_eq!(data["jobId"], job.job_id.as_str());
    assert_eq!(data["kind"], "report");
    assert_eq!(data["params"]["month"], "2026-09");
}

#[tokio::test]
async fn a_retry_with_the_same_key_returns_the_same_job_and_no_new_event() {
    let fx = fixture().await;
    let first = started(&fx, "k-1").await;
    let (status, headers, body) = send(&fx.app, start(Some("k-1"), r#"{"month":"2026-09"}"#)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(view(&body).job_id, first);
    assert_eq!(headers[header::LOCATION], format!("/jobs/{first}"));
    assert_eq!(fx.store.outbox_stats().await.expect("stats").unpublished, 1);

    // Another set of parameters under the same key: a client bug.
    let (status, headers, body) = send(&fx.app, start(Some("k-1"), r#"{"month":"2026-10"}"#)).await;
    assert_problem(status, &headers, &body, StatusCode::UNPROCESSABLE_ENTITY);
    // Another principal's same key is another job.
    let mut other = start(Some("k-1"), r#"{"month":"2026-09"}"#);
    other.headers_mut().insert(
        header::AUTHORIZATION,
        HeaderValue::from_static("Bearer bob"),
    );
    let (status, _, body) = send(&fx.app, other).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_ne!(view(&body).job_id, first);
    assert_eq!(fx.store.outbox_stats().await.expect("stats").unpublished, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_make_one_job_and_one_event() {
    let fx = fixture().await;
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let app = fx.app.clone();
        tasks.push(tokio::spawn(async move {
            send(&app, start(Some("racing"), r#"{"month":"2026-09"}"#)).await
        }));
    }
    let mut ids = HashSet::new();
    for task in tasks {
        let (status, _, body) = task.await.expect("task");
        assert_eq!(status, StatusCode::ACCEPTED);
        ids.insert(view(&body).job_id);
    }
    assert_eq!(ids.len(), 1, "every retry got the same job");
    assert_eq!(
        outbox_events(&fx.store).await.len(),
        1,
        "and one event was written"
    );
}

#[tokio::test]
async fn bad_requests_are_4xx_problems() {
    let fx = fixture_with(JobsOptions::new("report").max_params(1024), None).await;
    let (s, h, b) = send(&fx.app, start(None, "{}")).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&b).contains("Idempotency-Key"));
    let (s, h, b) = send(&fx.app, start(Some(&"k".repeat(256)), "{}")).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&b).contains("255"));
    let (s, h, b) = send(&fx.app, start(Some("ok"), "{not json")).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    let (s, h, b) = send(
        &fx.app,
        start(Some("ok"), &format!("\"{}\"", "x".repeat(2000))),
    )
    .await;
    assert_problem(s, &h, &b, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(fx.store.outbox_stats().await.expect("stats").unpublished, 0);
    // An empty body is a job without parameters.
    let (s, _, b) = send(&fx.app, start(Some("empty"), "")).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let id = view(&b).job_id;
    assert_eq!(
        fx.jobs.get(&id).await.expect("job").params,
        serde_json::json!({})
    );
}

#[tokio::test]
async fn status_while_queued_or_running_is_200_with_progress_and_retry_after() {
    let fx = fixture().await;
    let id = started(&fx, "k").await;
    let url = format!("/jobs/{id}");
    let (s, h, b) = get(&fx.app, &url).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h[header::RETRY_AFTER], "10");
    assert_eq!(h[header::CACHE_CONTROL], "no-store");
    assert_eq!((view(&b).status, view(&b).progress), (JobStatus::Queued, 0));

    fx.jobs.start(&id).await.expect("start");
    fx.jobs.progress(&id, 40).await.expect("progress");
    let (s, h, b) = get(&fx.app, &url).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h[header::RETRY_AFTER], "10");
    assert_eq!(
        (view(&b).status, view(&b).progress),
        (JobStatus::Running, 40)
    );
    let raw: serde_json::Value = serde_json::from_slice(&b).expect("json");
    assert!(raw["error"].is_null(), "error is present and null: {raw}");
}

#[tokio::test]
async fn status_of_a_succeeded_job_is_303_to_the_result() {
    let fx = fixture().await;
    let id = started(&fx, "k").await;
    fx.jobs.start(&id).await.expect("start");
    fx.jobs.succeed(&id, "/reports/7").await.expect("succeed");
    let (s, h, b) = get(&fx.app, &format!("/jobs/{id}")).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    assert_eq!(h[header::LOCATION], "/reports/7");
    assert!(h.get(header::RETRY_AFTER).is_none());
    assert!(b.is_empty());
}

#[tokio::test]
async fn status_of_a_failed_job_is_200_with_the_error() {
    let fx = fixture().await;
    let id = started(&fx, "k").await;
    fx.jobs.start(&id).await.expect("start");
    fx.jobs
        .fail(&id, "the ledger for 2026-09 is closed")
        .await
        .expect("fail");
    let (s, h, b) = get(&fx.app, &format!("/jobs/{id}")).await;
    assert_eq!(
        s,
        StatusCode::OK,
        "a failed job is still a successful status request"
    );
    assert!(
        h.get(header::RETRY_AFTER).is_none(),
        "nothing more to wait for"
    );
    let job = view(&b);
    assert_eq!(job.status, JobStatus::Failed);
    assert_eq!(
        job.error.as_deref(),
        Some("the ledger for 2026-09 is closed")
    );
}

#[tokio::test]
async fn unknown_jobs_are_404_and_expired_ones_410() {
    let fx = fixture_with(
        JobsOptions::new("report").ttl(Duration::from_millis(150)),
        None,
    )
    .await;
    for uri in [
        "/jobs/does-not-exist",
        &format!("/jobs/{}", "x".repeat(500)),
    ] {
        let (s, h, b) = get(&fx.app, uri).await;
        assert_problem(s, &h, &b, StatusCode::NOT_FOUND);
        let (s, h, b) = delete(&fx.app, uri).await;
        assert_problem(s, &h, &b, StatusCode::NOT_FOUND);
    }
    let id = started(&fx, "k").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (s, h, b) = get(&fx.app, &format!("/jobs/{id}")).await;
    assert_problem(s, &h, &b, StatusCode::GONE);
    let (s, h, b) = delete(&fx.app, &format!("/jobs/{id}")).await;
    assert_problem(s, &h, &b, StatusCode::GONE);
    assert!(matches!(
        fx.jobs.start(&id).await,
        Err(JobError::Expired { .. })
    ));
    // Retrying the POST of an expired job: gone too, not a 202 for a dead job.
    let (s, h, b) = send(&fx.app, start(Some("k"), r#"{"month":"2026-09"}"#)).await;
    assert_problem(s, &h, &b, StatusCode::GONE);

    // Pruned after a grace period: then unknown.
    assert_eq!(
        fx.jobs
            .prune(Duration::from_secs(3600), 10)
            .await
            .expect("prune"),
        0
    );
    assert_eq!(fx.jobs.prune(Duration::ZERO, 10).await.expect("prune"), 1);
    let (s, h, b) = get(&fx.app, &format!("/jobs/{id}")).await;
    assert_problem(s, &h, &b, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn delete_cancels_queued_and_running_jobs_and_409s_finished_ones() {
    let fx = fixture().await;
    // Queued: cancelled at once, 200.
    let queued = started(&fx, "q").await;
    let (s, h, b) = delete(&fx.app, &format!("/jobs/{queued}")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h[header::CACHE_CONTROL], "no-store");
    assert_eq!(view(&b).status, JobStatus::Cancelled);
    // Again: still 200 (a retried DELETE succeeds).
    let (s, _, b) = delete(&fx.app, &format!("/jobs/{queued}")).await;
    assert_eq!((s, view(&b).status), (StatusCode::OK, JobStatus::Cancelled));
    let (s, h, b) = get(&fx.app, &format!("/jobs/{queued}")).await;
    assert_eq!((s, view(&b).status), (StatusCode::OK, JobStatus::Cancelled));
    assert!(h.get(header::RETRY_AFTER).is_none());
    assert!(matches!(
        fx.jobs.start(&queued).await,
        Err(JobError::AlreadyFinal {
            status: JobStatus::Cancelled,
            ..
        })
    ));

    // Running: 202, and the worker learns at its next update.
    let running = started(&fx, "r").await;
    fx.jobs.start(&running).await.expect("start");
    let (s, _, b) = delete(&fx.app, &format!("/jobs/{running}")).await;
    assert_eq!(
        (s, view(&b).status),
        (StatusCode::ACCEPTED, JobStatus::Cancelled)
    );
    let err = fx.jobs.progress(&running, 50).await.expect_err("cancelled");
    assert!(matches!(
        err,
        JobError::AlreadyFinal {
            status: JobStatus::Cancelled,
            ..
        }
    ));
    assert!(
        fx.jobs.succeed(&running, "/reports/1").await.is_err(),
        "cannot succeed any more"
    );

    // Succeeded or failed: 409.
    let done = started(&fx, "d").await;
    fx.jobs.succeed(&done, "/reports/2").await.expect("succeed");
    let (s, h, b) = delete(&fx.app, &format!("/jobs/{done}")).await;
    assert_problem(s, &h, &b, StatusCode::CONFLICT);
    let failed = started(&fx, "f").await;
    fx.jobs.fail(&failed, "no data").await.expect("fail");
    let (s, h, b) = delete(&fx.app, &format!("/jobs/{failed}")).await;
    assert_problem(s, &h, &b, StatusCode::CONFLICT);
    assert_eq!(
        fx.jobs.cancel(&queued).await.expect("cancel"),
        Cancelled::Already
    );
}

#[tokio::test]
async fn the_job_row_and_its_event_commit_together() {
    // An outbox that refuses the event (too large) must take the job with it.
    let fx = fixture_with(JobsOptions::new("report"), Some(200)).await;
    let params = format!(r#"{{"note":"{}"}}"#, "x".repeat(300));
    let (s, h, b) = send(&fx.app, start(Some("big"), &params)).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(h[header::CONTENT_TYPE], PROBLEM_JSON);
    assert!(
        !String::from_utf8_lossy(&b).contains("bytes"),
        "internals are not leaked"
    );
    let jobs: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM keel_jobs")
        .fetch_one(fx.store.pool())
        .await
        .expect("count");
    assert_eq!(jobs, 0, "no job without its event");
    assert_eq!(fx.store.outbox_stats().await.expect("stats").unpublished, 0);
}

#[tokio::test]
async fn options_are_validated_and_paths_configurable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    for bad in [
        JobsOptions::new(""),
        JobsOptions::new("report").base_path("jobs"),
        JobsOptions::new("report").base_path("/jobs/"),
        JobsOptions::new("report").ttl(Duration::ZERO),
        JobsOptions::new("report").topic(""),
        JobsOptions::new("report").max_params(0),
    ] {
        assert!(Jobs::new(Outbox::new(store.clone()), bad).is_err());
    }
    let options = JobsOptions::new("export")
        .base_path("/v1/exports/status")
        .accepted_retry_after(Duration::from_millis(1500))
        .poll_retry_after(Duration::from_secs(3));
    let jobs = Jobs::new(Outbox::new(store), options).expect("options");
    let app = Router::new()
        .route("/v1/exports", jobs.create_route())
        .merge(jobs.routes());
    let request = Request::post("/v1/exports")
        .header("idempotency-key", "\"quoted-key\"")
        .body(Body::from("{}"))
        .expect("request");
    let (s, h, b) = send(&app, request).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(h[header::RETRY_AFTER], "2", "rounded up");
    let url = format!("/v1/exports/status/{}", view(&b).job_id);
    assert_eq!(h[header::LOCATION], url.as_str());
    let (s, h, _) = get(&app, &url).await;
    assert_eq!(
        (s, &h[header::RETRY_AFTER]),
        (StatusCode::OK, &HeaderValue::from_static("3"))
    );
}
