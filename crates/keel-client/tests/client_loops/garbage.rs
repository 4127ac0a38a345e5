//! A server that answers something other than the protocol: each client
//! returns a typed error, and asking again waits instead of spinning.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use keel_client::{
    JobClient, JobError, KeelSocket, LongPoll, LoopError, PropagatingClient, Reconnect, SseClient,
};
use keel_policy::retry::{Backoff, Jitter};

use super::STEP;

struct Garbage {
    base: String,
    hits: Arc<AtomicUsize>,
}

async fn garbage_server() -> Garbage {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let app = Router::new()
        .route("/updates", get(|| async { "<html>not a batch</html>" }))
        .route("/backwards", get(|| async { axum::Json(serde_json::json!({"events": [{"seq": 1, "type": "t", "data": null, "at": "2026-12-03T00:00:00Z"}], "cursor": -5})) }))
        .route("/stream", get(|| async { ([("content-type", "text/html")], "<html></html>") }))
        .route("/huge", get(|| async { ([("content-type", "text/event-stream")], format!("data: {}", "x".repeat(64 * 1024))) }))
        .route("/ws", get(|| async { "no upgrade here" }))
        .route("/reports", post(|| async { StatusCode::ACCEPTED }))
        .route("/weird", post(|| async { (StatusCode::ACCEPTED, [("location", "/jobs/weird")]) }))
        .route("/jobs/weird", get(|| async { axum::Json(serde_json::json!({"status": "sideways"})) }))
        .layer(axum::middleware::from_fn(move |request, next: axum::middleware::Next| {
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                next.run(request).await
            }
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Garbage { base, hits }
}

/// A delay long enough to see whether a second call waits.
fn slow_reconnect() -> Reconnect {
    Reconnect::new().backoff(
        Backoff::exponential(Duration::from_secs(5), 2.0, Duration::from_secs(5))
            .and_then(|b| b.with_jitter(Jitter::None))
            .expect("valid backoff"),
    )
}

fn protocol<T: std::fmt::Debug>(outcome: Result<T, LoopError>) {
    assert!(
        matches!(outcome, Err(LoopError::Protocol { .. })),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_long_poll_of_garbage_is_a_protocol_error_and_the_next_call_waits() {
    let server = garbage_server().await;
    let client = PropagatingClient::new(reqwest::Client::new());
    let url = format!("{}/updates", server.base).parse().expect("url");
    let mut updates = LongPoll::builder(&client, url)
        .reconnect(slow_reconnect())
        .build();
    protocol(
        tokio::time::timeout(STEP, updates.next())
            .await
            .expect("an answer"),
    );
    // Called again at once, it waits its delay rather than asking again.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), updates.next())
            .await
            .is_err()
    );
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);

    let url = format!("{}/backwards", server.base).parse().expect("url");
    let mut backwards = LongPoll::builder(&client, url)
        .reconnect(slow_reconnect())
        .build();
    protocol(
        tokio::time::timeout(STEP, backwards.next())
            .await
            .expect("an answer"),
    );
}

#[tokio::test]
async fn an_sse_answer_that_is_not_a_stream_or_an_event_too_large_is_a_protocol_error() {
    let server = garbage_server().await;
    let client = PropagatingClient::new(reqwest::Client::new());
    let mut html = SseClient::builder(
        &client,
        format!("{}/stream", server.base).parse().expect("url"),
    )
    .reconnect(slow_reconnect())
    .build();
    protocol(
        tokio::time::timeout(STEP, html.next())
            .await
            .expect("an answer"),
    );
    let mut huge = SseClient::builder(
        &client,
        format!("{}/huge", server.base).parse().expect("url"),
    )
    .event_limit(16 * 1024)
    .reconnect(slow_reconnect())
    .build();
    protocol(
        tokio::time::timeout(STEP, huge.next())
            .await
            .expect("an answer"),
    );
}

#[tokio::test]
async fn a_server_that_does_not_upgrade_is_a_typed_error() {
    let server = garbage_server().await;
    let url = format!("{}/ws", server.base.replace("http", "ws"))
        .parse()
        .expect("url");
    let mut socket = KeelSocket::builder(url)
        .reconnect(slow_reconnect())
        .build()
        .expect("socket");
    let outcome = tokio::time::timeout(STEP, socket.next())
        .await
        .expect("an answer");
    assert!(
        matches!(
            outcome,
            Err(LoopError::Protocol { .. } | LoopError::Call(_))
        ),
        "{outcome:?}"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(500), socket.next())
            .await
            .is_err()
    );
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_job_server_without_location_or_with_an_unknown_status_is_a_typed_error() {
    let server = garbage_server().await;
    let client = PropagatingClient::new(reqwest::Client::new());
    let jobs = JobClient::new(&client).reconnect(slow_reconnect());
    let no_location = jobs
        .submit(client.inner().post(format!("{}/reports", server.base)))
        .await;
    assert!(
        matches!(no_location, Err(JobError::Loop(LoopError::Protocol { .. }))),
        "{no_location:?}"
    );
    let weird = jobs
        .submit(client.inner().post(format!("{}/weird", server.base)))
        .await
        .expect("accepted");
    let outcome = tokio::time::timeout(STEP, weird.wait())
        .await
        .expect("an answer");
    assert!(
        matches!(outcome, Err(JobError::Loop(LoopError::Protocol { .. }))),
        "{outcome:?}"
    );
}
