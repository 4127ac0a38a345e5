use std::time::Duration;

use keel_client::{JobClient, JobError, JobState, PropagatingClient};
use keel_store::JobStatus;

use super::server::Server;
use super::{STEP, quick_reconnect};

fn jobs_client() -> (PropagatingClient, JobClient) {
    let client = PropagatingClient::new(reqwest::Client::new());
    let jobs = JobClient::new(&client).reconnect(quick_reconnect());
    (client, jobs)
}

fn job_id(url: &reqwest::Url) -> String {
    url.path().trim_start_matches("/jobs/").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_job_rides_out_a_killed_server_and_follows_the_303() {
    let mut server = Server::start().await;
    let (client, jobs) = jobs_client();
    let job = jobs
        .submit(
            client
                .inner()
                .post(server.url("/reports"))
                .json(&serde_json::json!({"month": "2026-09"})),
        )
        .await
        .expect("accepted");
    let id = job_id(job.status_url());
    assert!(matches!(job.status().await, Ok(JobState::Pending { .. })));
    let waiting = tokio::spawn({
        let job = job.clone();
        async move { job.wait().await }
    });
    server.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart().await;
    let worker = server.jobs().await;
    worker.start(&id).await.expect("start");
    worker
        .succeed(&id, &format!("/reports/{id}"))
        .await
        .expect("succeed");

    let result = tokio::time::timeout(STEP, waiting)
        .await
        .expect("the wait ends")
        .expect("the wait runs")
        .expect("the result");
    assert_eq!(result.url().path(), format!("/reports/{id}"));
    assert_eq!(result.text().await.expect("body"), format!("report {id}"));
    assert_eq!(
        worker.get(&id).await.expect("job").status,
        JobStatus::Succeeded
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_submit_with_the_same_key_is_the_same_job() {
    let server = Server::start().await;
    let (client, jobs) = jobs_client();
    let submit = || {
        jobs.submit(
            client
                .inner()
                .post(server.url("/reports"))
                .header("idempotency-key", "report-2026-09")
                .json(&serde_json::json!({"month": "2026-09"})),
        )
    };
    let first = submit().await.expect("accepted");
    let second = submit().await.expect("accepted");
    assert_eq!(first.status_url(), second.status_url());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_and_a_cancelled_one_are_typed_ends() {
    let server = Server::start().await;
    let (client, jobs) = jobs_client();
    let post = || {
        client
            .inner()
            .post(server.url("/reports"))
            .json(&serde_json::json!({}))
    };
    let worker = server.jobs().await;

    let failing = jobs.submit(post()).await.expect("accepted");
    worker
        .fail(&job_id(failing.status_url()), "the ledger is closed")
        .await
        .expect("fail");
    match tokio::time::timeout(STEP, failing.wait())
        .await
        .expect("ends")
    {
        Err(JobError::Failed { error }) => assert_eq!(error, "the ledger is closed"),
        other => panic!("{other:?}"),
    }

    let cancelled = jobs.submit(post()).await.expect("accepted");
    cancelled.cancel().await.expect("cancelled");
    cancelled
        .cancel()
        .await
        .expect("a second cancel succeeds too");
    assert!(matches!(cancelled.wait().await, Err(JobError::Cancelled)));

    let unknown = keel_client::Job::resume(&jobs, server.url("/jobs/no-such-job"));
    assert!(matches!(unknown.status().await, Err(JobError::NotFound)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn giving_up_waiting_leaves_the_job_running_and_cancel_is_explicit() {
    let server = Server::start().await;
    let (client, jobs) = jobs_client();
    let job = jobs
        .submit(
            client
                .inner()
                .post(server.url("/reports"))
                .json(&serde_json::json!({})),
        )
        .await
        .expect("accepted");
    let id = job_id(job.status_url());
    let gave_up = tokio::time::timeout(Duration::from_millis(300), job.wait()).await;
    assert!(gave_up.is_err(), "the job cannot have finished");
    // Long enough for a DELETE sent on drop to have landed: none may.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let worker = server.jobs().await;
    let status = worker.get(&id).await.expect("job").status;
    assert_ne!(
        status,
        JobStatus::Cancelled,
        "giving up waiting cancelled the job"
    );
    // Another waiter picks the same job up; only an explicit cancel ends it.
    let resumed = keel_client::Job::resume(&jobs, job.status_url().clone());
    resumed.cancel().await.expect("cancelled");
    tokio::time::timeout(STEP, async {
        while worker.get(&id).await.expect("job").status != JobStatus::Cancelled {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the explicit cancel cancels the job");
}
