//! Long polling against a real SqliteStore on a temporary file, called
//! in-process: answers at once when events exist, wakes on an append, `204`
//! after the timeout (paused time), and refuses bad input with problems.

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use http_body_util::BodyExt;
use keel_realtime::{EventLog, Realtime, RealtimeOptions, Retention, StreamId};
use keel_sqlite::SqliteStore;
use serde_json::{Value, json};
use tokio::time::Instant;
use tower::ServiceExt;

mod common;
use common::{Fixture, alice};

async fn fixture(options: RealtimeOptions) -> Fixture {
    common::fixture(options, "/updates", |builder| builder, Realtime::long_poll).await
}

fn poll_request(user: Option<&str>, query: &str) -> Request<Body> {
    let mut request = Request::get(format!("/updates{query}"));
    if let Some(user) = user {
        request = request.header("x-user", user);
    }
    request.body(Body::empty()).expect("request")
}

async fn call(app: &Router, request: Request<Body>) -> Response {
    app.clone().oneshot(request).await.expect("infallible")
}

async fn json_body(response: Response) -> Value {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    serde_json::from_slice(&bytes).expect("JSON body")
}

fn seqs(body: &Value) -> Vec<i64> {
    body["events"]
        .as_array()
        .expect("events array")
        .iter()
        .map(|e| e["seq"].as_i64().expect("seq"))
        .collect()
}

async fn publish(log: &EventLog<SqliteStore>, stream: &StreamId, n: i64) -> i64 {
    log.publish(stream, "order.updated", &json!({ "n": n }))
        .await
        .expect("publish")
}

/// Waits (real time) until `n` long polls are parked waiting for events.
async fn until_waiting(realtime: &Realtime<SqliteStore>, n: u64) {
    for _ in 0..500 {
        if realtime.stats().long_polls_waiting == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("long polls never started waiting");
}

/// Freezes tokio's clock; returns the frozen "now".
fn pause() -> Instant {
    tokio::time::pause();
    Instant::now()
}

/// Moves the frozen clock forward to `at` (if it is ahead) and lets woken
/// tasks run.
async fn advance_to(at: Instant) {
    tokio::time::advance(at.saturating_duration_since(Instant::now())).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn answers_at_once_when_events_exist() {
    let f = fixture(RealtimeOptions::new()).await;
    for n in 1..=3 {
        publish(&f.log, &alice(), n).await;
    }
    let response = call(&f.app, poll_request(Some("alice"), "?after=0")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    let body = json_body(response).await;
    assert_eq!(seqs(&body), vec![1, 2, 3]);
    assert_eq!(body["cursor"], 3);
    assert_eq!(body["events"][0]["type"], "order.updated");
    assert_eq!(body["events"][0]["data"], json!({ "n": 1 }));
    assert!(body["events"][0]["at"].is_string());
    assert!(body.get("truncated").is_none(), "only present when true");

    // The cursor moves on; no `after` means from the start.
    let body = json_body(call(&f.app, poll_request(Some("alice"), "?after=2")).await).await;
    assert_eq!((seqs(&body), body["cursor"].clone()), (vec![3], json!(3)));
    let body = json_body(call(&f.app, poll_request(Some("alice"), "")).await).await;
    assert_eq!(seqs(&body), vec![1, 2, 3]);
}

#[tokio::test]
async fn answers_at_most_one_batch() {
    let options = RealtimeOptions::new().read_batch(NonZeroUsize::new(2).expect("non-zero"));
    let f = fixture(options).await;
    for n in 1..=5 {
        publish(&f.log, &alice(), n).await;
    }
    let body = json_body(call(&f.app, poll_request(Some("alice"), "?after=0")).await).await;
    assert_eq!(
        (seqs(&body), body["cursor"].clone()),
        (vec![1, 2], json!(2))
    );
    let body = json_body(call(&f.app, poll_request(Some("alice"), "?after=2")).await).await;
    assert_eq!(
        (seqs(&body), body["cursor"].clone()),
        (vec![3, 4], json!(4))
    );
}

#[tokio::test]
async fn wakes_promptly_when_an_event_is_appended_during_the_wait() {
    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, &alice(), 1).await;
    let app = f.app.clone();
    let waiting =
        tokio::spawn(async move { call(&app, poll_request(Some("alice"), "?after=1")).await });
    until_waiting(&f.realtime, 1).await;

    // Another user's event does not wake alice.
    publish(&f.log, &StreamId::new("user:bob").expect("id"), 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !waiting.is_finished(),
        "bob's event must not answer alice's poll"
    );

    let appended = Instant::now();
    publish(&f.log, &alice(), 2).await;
    let response = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("answered promptly after the append, not after 25 s")
        .expect("task");
    assert!(appended.elapsed() < Duration::from_secs(2));
    assert_eq!(response.status(), StatusCode::OK);
    let body = json_body(response).await;
    assert_eq!((seqs(&body), body["cursor"].clone()), (vec![2], json!(2)));
    assert_eq!(f.realtime.stats().long_polls_waiting, 0);
}

#[tokio::test]
async fn answers_204_after_25_seconds_without_events() {
    let f = fixture(RealtimeOptions::new()).await; // the default timeout: 25 s
    publish(&f.log, &alice(), 1).await;
    let app = f.app.clone();
    let started = Instant::now();
    let waiting =
        tokio::spawn(async move { call(&app, poll_request(Some("alice"), "?after=1")).await });
    until_waiting(&f.realtime, 1).await;

    // The store is not touched again until the timeout: freeze the clock.
    let paused_at = pause();
    advance_to(started + Duration::from_millis(24_900)).await;
    assert!(!waiting.is_finished(), "still waiting at 24.9 s");
    advance_to(paused_at + Duration::from_millis(25_100)).await;
    let response = waiting.await.expect("task");
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert!(bytes.is_empty());
}

#[tokio::test]
async fn the_timeout_is_configurable() {
    let f = fixture(RealtimeOptions::new().poll_timeout(Duration::from_secs(3))).await;
    let app = f.app.clone();
    let started = Instant::now();
    let waiting = tokio::spawn(async move { call(&app, poll_request(Some("alice"), "")).await });
    until_waiting(&f.realtime, 1).await;
    let paused_at = pause();
    advance_to(started + Duration::from_millis(2_900)).await;
    assert!(!waiting.is_finished());
    advance_to(paused_at + Duration::from_millis(3_100)).await;
    assert_eq!(
        waiting.await.expect("task").status(),
        StatusCode::NO_CONTENT
    );
}

async fn assert_problem(response: Response, status: StatusCode, detail_has: &str) {
    assert_eq!(response.status(), status);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let body = json_body(response).await;
    assert_eq!(body["status"], status.as_u16());
    let detail = body["detail"].as_str().expect("detail");
    assert!(detail.contains(detail_has), "{detail}");
}

#[tokio::test]
async fn a_bad_cursor_is_a_400_problem() {
    let f = fixture(RealtimeOptions::new()).await;
    let too_long = format!("?after={}", "1".repeat(21));
    for query in [
        "?after=abc",
        "?after=-1",
        "?after=",
        "?after=1.5",
        "?after=1&after=2",
        too_long.as_str(),
    ] {
        let response = call(&f.app, poll_request(Some("alice"), query)).await;
        assert_problem(response, StatusCode::BAD_REQUEST, "cursor").await;
    }
}

#[tokio::test]
async fn an_unauthenticated_poll_is_a_401_problem() {
    let f = fixture(RealtimeOptions::new()).await;
    let response = call(&f.app, poll_request(None, "?after=0")).await;
    assert_problem(
        response,
        StatusCode::UNAUTHORIZED,
        "authentication required",
    )
    .await;
}

#[tokio::test]
async fn drain_answers_waiting_polls_and_refuses_new_ones() {
    let f = fixture(RealtimeOptions::new()).await;
    let app = f.app.clone();
    let waiting = tokio::spawn(async move { call(&app, poll_request(Some("alice"), "")).await });
    until_waiting(&f.realtime, 1).await;
    f.drain.send_replace(true);
    let response = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("answered at once on drain")
        .expect("task");
    assert_eq!(response.status(), StatusCode::NO_CONTENT);

    let response = call(&f.app, poll_request(Some("alice"), "")).await;
    assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    assert_problem(response, StatusCode::SERVICE_UNAVAILABLE, "shutting down").await;
}

#[tokio::test]
async fn a_cursor_behind_retention_is_flagged_truncated() {
    let f = fixture(RealtimeOptions::new()).await;
    for n in 1..=5 {
        publish(&f.log, &alice(), n).await;
    }
    let retention = Retention::new().max_age(None).keep_last(NonZeroU64::new(2));
    assert_eq!(f.log.trim(&retention).await.expect("trim"), 3);
    let body = json_body(call(&f.app, poll_request(Some("alice"), "?after=1")).await).await;
    assert_eq!(seqs(&body), vec![4, 5]);
    assert_eq!(body["truncated"], true);
    // A client that was up to date is not told anything.
    let body = json_body(call(&f.app, poll_request(Some("alice"), "?after=4")).await).await;
    assert_eq!(seqs(&body), vec![5]);
    assert!(body.get("truncated").is_none());
}

#[tokio::test]
async fn a_quiet_poll_under_a_shorter_deadline_answers_204_before_it_not_504() {
    use keel_http::propagation::DeadlineLayer;
    let f = fixture(RealtimeOptions::new()).await;
    let capped = f
        .app
        .clone()
        .layer(DeadlineLayer::with_max(Duration::from_secs(2)).expect("cap"));
    let started = Instant::now();
    let response = call(&capped, poll_request(Some("alice"), "")).await;
    let waited = started.elapsed();
    assert_eq!(response.status(), StatusCode::NO_CONTENT, "not a 504");
    assert!(
        waited >= Duration::from_millis(1_400) && waited < Duration::from_secs(2),
        "answered just before the 2 s deadline: {waited:?}"
    );
    let soon = keel_core::clock::unix_millis() + 1_000;
    let request = Request::get("/updates")
        .header("x-user", "alice")
        .header("x-request-deadline-unix-ms", soon.to_string())
        .body(Body::empty())
        .expect("request");
    let started = Instant::now();
    let response = call(&capped, request).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the caller's own deadline"
    );
}
