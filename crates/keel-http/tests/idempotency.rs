//! The Idempotency-Key layer against a real SQLite store on a temp file:
//! every status it answers with, replay byte for byte, concurrent
//! duplicates executing once, principals, release, expiry and pruning, a
//! store that fails while a key is settled, and a handler that completes
//! its key in its own transaction.
#![cfg(feature = "idempotency")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use keel_http::idempotency::{
    HeldKey, IdempotencyLayer, IdempotencyOptions, InvalidIdempotencyOptions, prune_expired,
};
use keel_http::problem::PROBLEM_JSON;
use keel_sqlite::SqliteStore;
use keel_store::StoreError;
use keel_store::{IdempotencyBegin, IdempotencyClaim, IdempotencyStore, Store, StoredResponse};
use keel_testkit::metrics::MetricsRecorder;
use tempfile::TempDir;
use tokio::sync::Notify;
use tower::ServiceExt;

struct Fixture {
    store: SqliteStore,
    _dir: TempDir,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    Fixture { store, _dir: dir }
}

/// A handler that counts its runs and answers `201` with a body naming the
/// run, a `Location`, a custom header and the caller's authorization.
fn counting_app(runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/orders",
        post(move |headers: HeaderMap, body: Bytes| {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let who = headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("nobody")
                    .to_owned();
                (
                    StatusCode::CREATED,
                    [
                        (header::LOCATION, format!("/orders/{run}")),
                        (header::CONTENT_TYPE, "application/json".to_owned()),
                        (header::HeaderName::from_static("x-run"), run.to_string()),
                    ],
                    format!(r#"{{"run":{run},"who":"{who}","bytes":{}}}"#, body.len()),
                )
            }
        })
        .get(|| async { "listed" }),
    )
}

fn post_req(key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post("/orders").header(header::CONTENT_TYPE, "application/json");
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

fn assert_problem(status: StatusCode, headers: &HeaderMap, body: &Bytes, expected: StatusCode) {
    assert_eq!(status, expected, "body: {}", String::from_utf8_lossy(body));
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let problem: serde_json::Value = serde_json::from_slice(body).expect("problem json");
    assert_eq!(problem["status"], expected.as_u16());
    assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
}

#[tokio::test]
async fn first_request_runs_and_a_retry_replays_identical_bytes() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));

    let (s1, h1, b1) = send(&app, post_req(Some("order-1"), r#"{"sku":"tea"}"#)).await;
    assert_eq!(s1, StatusCode::CREATED);
    assert!(
        h1.get("idempotent-replayed").is_none(),
        "the original is not a replay"
    );

    let (s2, h2, b2) = send(&app, post_req(Some("order-1"), r#"{"sku":"tea"}"#)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(s2, s1);
    assert_eq!(b2, b1, "the replay has the same bytes");
    assert_eq!(h2["idempotent-replayed"], "true");
    for name in [
        header::LOCATION,
        header::CONTENT_TYPE,
        header::HeaderName::from_static("x-run"),
    ] {
        assert_eq!(h2.get(&name), h1.get(&name), "{name} replayed");
    }
    // A third time: still the same.
    let (s3, _, b3) = send(&app, post_req(Some("\"order-1\""), r#"{"sku":"tea"}"#)).await;
    assert_eq!((s3, b3), (s1, b1), "a quoted sf-string key is the same key");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_missing_key_is_400_unless_optional() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let (s, h, b) = send(&app, post_req(None, "{}")).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&b).contains("Idempotency-Key"));
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let optional =
        IdempotencyLayer::with_options(fx.store.clone(), IdempotencyOptions::new().required(false))
            .expect("options");
    let app = counting_app(runs.clone()).layer(optional);
    let (s, _, _) = send(&app, post_req(None, "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _, _) = send(&app, post_req(None, "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "without a key nothing is deduplicated"
    );
}

#[tokio::test]
async fn methods_not_protected_pass_through() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let (s, h, b) = send(
        &app,
        Request::get("/orders").body(Body::empty()).expect("req"),
    )
    .await;
    assert_eq!((s, b.as_ref()), (StatusCode::OK, &b"listed"[..]));
    assert!(h.get("idempotent-replayed").is_none());

    // PUT is not protected by default; configured methods are.
    let only_put = IdempotencyOptions::new().methods([Method::PUT]);
    let app = Router::new()
        .route(
            "/orders",
            post(|| async { "posted" }).put(|| async { "put" }),
        )
        .layer(IdempotencyLayer::with_options(fx.store.clone(), only_put).expect("options"));
    let (s, _, _) = send(&app, post_req(None, "{}")).await;
    assert_eq!(s, StatusCode::OK);
    let put = Request::put("/orders").body(Body::empty()).expect("req");
    let (s, h, b) = send(&app, put).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn malformed_and_overlong_keys_are_400() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));

    let max = "k".repeat(255);
    let (s, _, _) = send(&app, post_req(Some(&max), "{}")).await;
    assert_eq!(s, StatusCode::CREATED, "255 characters are allowed");

    let over = "k".repeat(256);
    let (s, h, b) = send(&app, post_req(Some(&over), "{}")).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&b).contains("255"));

    let mut non_ascii = post_req(None, "{}");
    non_ascii.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_bytes(b"caf\xc3\xa9-1").expect("obs-text is a valid header value"),
    );
    let (s, h, b) = send(&app, non_ascii).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);

    for bad in ["", "\"\"", "has space", "\"open"] {
        let (s, h, b) = send(&app, post_req(Some(bad), "{}")).await;
        assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    }
    let mut two = post_req(Some("a"), "{}");
    two.headers_mut()
        .append("idempotency-key", HeaderValue::from_static("b"));
    let (s, h, b) = send(&app, two).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the valid key ran");
}

#[tokio::test]
async fn an_oversized_body_is_413() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let layer =
        IdempotencyLayer::with_options(fx.store.clone(), IdempotencyOptions::new().max_body(1024))
            .expect("options");
    let app = counting_app(runs.clone()).layer(layer);

    // Without Content-Length: caught while reading.
    let (s, h, b) = send(&app, post_req(Some("big-1"), &"x".repeat(1025))).await;
    assert_problem(s, &h, &b, StatusCode::PAYLOAD_TOO_LARGE);
    // With Content-Length: refused before reading.
    let mut declared = post_req(Some("big-2"), "{}");
    declared
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from_static("1048577"));
    let (s, h, b) = send(&app, declared).await;
    assert_problem(s, &h, &b, StatusCode::PAYLOAD_TOO_LARGE);
    // At the limit: fine.
    let (s, _, _) = send(&app, post_req(Some("big-3"), &"x".repeat(1024))).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Declared at the limit: fine too.
    let mut declared = post_req(Some("big-5"), &"x".repeat(1024));
    declared
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from_static("1024"));
    let (s, _, _) = send(&app, declared).await;
    assert_eq!(
        s,
        StatusCode::CREATED,
        "a declared length at the limit is read"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The default limit is 1 MiB.
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let (s, h, b) = send(&app, post_req(Some("big-4"), &"x".repeat(1024 * 1024 + 1))).await;
    assert_problem(s, &h, &b, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn the_same_key_for_another_request_is_422() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let (s, _, _) = send(&app, post_req(Some("k"), r#"{"sku":"tea"}"#)).await;
    assert_eq!(s, StatusCode::CREATED);

    let (s, h, b) = send(&app, post_req(Some("k"), r#"{"sku":"coffee"}"#)).await;
    assert_problem(s, &h, &b, StatusCode::UNPROCESSABLE_ENTITY);
    let other_query = Request::post("/orders?express=1")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", "k")
        .body(Body::from(r#"{"sku":"tea"}"#))
        .expect("req");
    let (s, h, b) = send(&app, other_query).await;
    assert_problem(s, &h, &b, StatusCode::UNPROCESSABLE_ENTITY);
    let other_type = Request::post("/orders")
        .header(header::CONTENT_TYPE, "text/plain")
        .header("idempotency-key", "k")
        .body(Body::from(r#"{"sku":"tea"}"#))
        .expect("req");
    let (s, h, b) = send(&app, other_type).await;
    assert_problem(s, &h, &b, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A handler that signals it started and waits for permission to finish.
fn gated_app(runs: Arc<AtomicUsize>, entered: Arc<Notify>, proceed: Arc<Notify>) -> Router {
    Router::new().route(
        "/orders",
        post(move || {
            let (runs, entered, proceed) = (runs.clone(), entered.clone(), proceed.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                entered.notify_one();
                proceed.notified().await;
                (StatusCode::CREATED, "done")
            }
        }),
    )
}

#[tokio::test]
async fn a_duplicate_in_flight_is_409_with_retry_after() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (entered, proceed) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = gated_app(runs.clone(), entered.clone(), proceed.clone())
        .layer(IdempotencyLayer::new(fx.store.clone()));

    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_req(Some("slow"), "{}")).await }
    });
    entered.notified().await;
    let (s, h, b) = send(&app, post_req(Some("slow"), "{}")).await;
    assert_problem(s, &h, &b, StatusCode::CONFLICT);
    assert_eq!(h[header::RETRY_AFTER], "1");
    // A different request under the key in flight is a reuse, not a wait.
    let (s, h, b) = send(&app, post_req(Some("slow"), r#"{"other":1}"#)).await;
    assert_problem(s, &h, &b, StatusCode::UNPROCESSABLE_ENTITY);

    proceed.notify_one();
    let (s, _, b) = first.await.expect("task");
    assert_eq!((s, b.as_ref()), (StatusCode::CREATED, &b"done"[..]));
    let (s, h, b) = send(&app, post_req(Some("slow"), "{}")).await;
    assert_eq!((s, b.as_ref()), (StatusCode::CREATED, &b"done"[..]));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_execute_once() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders",
            post({
                let runs = runs.clone();
                move || {
                    let runs = runs.clone();
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        (StatusCode::CREATED, format!("run {run}"))
                    }
                }
            }),
        )
        .layer(IdempotencyLayer::new(fx.store.clone()));

    let start = Arc::new(tokio::sync::Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (app, start) = (app.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            send(&app, post_req(Some("race"), r#"{"sku":"tea"}"#)).await
        }));
    }
    let (mut originals, mut replays, mut conflicts) = (0, 0, 0);
    for task in tasks {
        let (status, headers, body) = task.await.expect("task");
        match status {
            StatusCode::CREATED => {
                assert_eq!(body.as_ref(), b"run 1");
                if headers.contains_key("idempotent-replayed") {
                    replays += 1;
                } else {
                    originals += 1;
                }
            }
            StatusCode::CONFLICT => {
                assert!(headers.contains_key(header::RETRY_AFTER));
                conflicts += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran exactly once"
    );
    assert_eq!(originals, 1);
    assert_eq!(originals + replays + conflicts, 20);
}

#[tokio::test]
async fn keys_are_scoped_per_principal() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let as_user = |token: &str, body: &str| {
        let mut req = post_req(Some("shared-key"), body);
        req.headers_mut().insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).expect("header"),
        );
        req
    };
    let (_, _, alice) = send(&app, as_user("alice", r#"{"a":1}"#)).await;
    // Bob's request with the same key is his own: it runs, no 422.
    let (s, h, bob) = send(&app, as_user("bob", r#"{"b":2}"#)).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let (_, _, alice_again) = send(&app, as_user("alice", r#"{"a":1}"#)).await;
    let (_, _, bob_again) = send(&app, as_user("bob", r#"{"b":2}"#)).await;
    assert_eq!(alice_again, alice);
    assert_eq!(bob_again, bob);
    assert!(String::from_utf8_lossy(&alice).contains("Bearer alice"));
    assert!(String::from_utf8_lossy(&bob).contains("Bearer bob"));

    // A custom principal: the user id from a header set by an auth layer.
    let by_user = IdempotencyOptions::new().principal(|parts| {
        parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous")
            .to_owned()
    });
    let app = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(fx.store.clone(), by_user).expect("options"));
    let mut req = as_user("rotated-token", r#"{"a":1}"#);
    req.headers_mut()
        .insert("x-user", HeaderValue::from_static("u-1"));
    let (s, _, _) = send(&app, req).await;
    assert_eq!(s, StatusCode::CREATED);
    let mut req = as_user("refreshed-token", r#"{"a":1}"#);
    req.headers_mut()
        .insert("x-user", HeaderValue::from_static("u-1"));
    let (_, h, _) = send(&app, req).await;
    assert_eq!(
        h["idempotent-replayed"], "true",
        "same user, new token: same key"
    );
}

#[tokio::test]
async fn server_errors_and_429_release_the_key_other_statuses_are_stored() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let statuses = [
        StatusCode::INTERNAL_SERVER_ERROR,
        StatusCode::SERVICE_UNAVAILABLE,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::CREATED,
    ];
    let app = Router::new()
        .route(
            "/orders",
            post({
                let runs = runs.clone();
                move || {
                    let runs = runs.clone();
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst);
                        (statuses[run.min(3)], format!("attempt {run}"))
                    }
                }
            }),
        )
        .layer(IdempotencyLayer::new(fx.store.clone()));
    for (attempt, expected) in statuses.iter().enumerate() {
        let (s, h, b) = send(&app, post_req(Some("flaky"), "{}")).await;
        assert_eq!(s, *expected);
        assert!(
            h.get("idempotent-replayed").is_none(),
            "attempt {attempt} ran"
        );
        assert_eq!(b, format!("attempt {attempt}"));
    }
    let (s, h, b) = send(&app, post_req(Some("flaky"), "{}")).await;
    assert_eq!((s, b.as_ref()), (StatusCode::CREATED, &b"attempt 3"[..]));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 4);

    // A 4xx is the answer to this request: stored and replayed.
    let app = Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::BAD_REQUEST, "sku unknown") }),
        )
        .layer(IdempotencyLayer::new(fx.store.clone()));
    send(&app, post_req(Some("invalid"), "{}")).await;
    let (s, h, _) = send(&app, post_req(Some("invalid"), "{}")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(h["idempotent-replayed"], "true");
}

#[tokio::test]
async fn a_dropped_request_releases_its_key() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (entered, proceed) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = gated_app(runs.clone(), entered.clone(), proceed.clone())
        .layer(IdempotencyLayer::new(fx.store.clone()));

    let client = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_req(Some("gone"), "{}")).await }
    });
    entered.notified().await;
    // The client disconnects: the server drops the request's future.
    client.abort();
    assert!(client.await.expect_err("aborted").is_cancelled());

    // The release runs in the background; the retry soon runs the handler.
    let mut status = StatusCode::CONFLICT;
    for _ in 0..100 {
        let mut retry = tokio::spawn({
            let app = app.clone();
            async move { send(&app, post_req(Some("gone"), "{}")).await }
        });
        let ran = tokio::select! {
            _ = entered.notified() => true,
            done = &mut retry => {
                let (s, _, _) = done.expect("task");
                assert_eq!(s, StatusCode::CONFLICT, "still in flight until released");
                false
            }
        };
        if ran {
            proceed.notify_one();
            status = retry.await.expect("task").0;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the retry ran after the release"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn expired_keys_run_again_and_are_pruned() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let short = IdempotencyOptions::new()
        .ttl(Duration::from_millis(500))
        .lock(Duration::from_millis(500));
    let app = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(fx.store.clone(), short).expect("options"));
    send(&app, post_req(Some("old"), "{}")).await;
    send(&app, post_req(Some("older"), "{}")).await;
    let (_, h, _) = send(&app, post_req(Some("old"), "{}")).await;
    assert_eq!(h["idempotent-replayed"], "true", "within the TTL: replayed");

    tokio::time::sleep(Duration::from_millis(600)).await;
    let (s, h, _) = send(&app, post_req(Some("old"), r#"{"new":true}"#)).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(
        h.get("idempotent-replayed").is_none(),
        "after the TTL: a new request"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // "older" expired and is pruned; "old" was just renewed and stays.
    assert_eq!(prune_expired(&fx.store, 1).await.expect("prune"), 1);
    assert_eq!(prune_expired(&fx.store, 100).await.expect("prune"), 0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(prune_expired(&fx.store, 100).await.expect("prune"), 1);
}

#[tokio::test]
async fn a_response_too_large_to_store_replays_without_body() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let options = IdempotencyOptions::new().max_response_body(8);
    let app = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(fx.store.clone(), options).expect("options"));
    let (s, _, b) = send(&app, post_req(Some("large"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(b.len() > 8, "the live response is complete");
    let (s, h, b) = send(&app, post_req(Some("large"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(h["idempotent-body-omitted"], "true");
    assert_eq!(
        h[header::LOCATION],
        "/orders/1",
        "Location still tells where it is"
    );
    assert!(b.is_empty());
    assert!(h.get(header::CONTENT_TYPE).is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never run twice");
}

#[tokio::test]
async fn options_that_cannot_work_are_refused() {
    let fx = fixture().await;
    let refuse = |options: IdempotencyOptions| {
        IdempotencyLayer::with_options(fx.store.clone(), options).expect_err("invalid")
    };
    assert_eq!(
        refuse(IdempotencyOptions::new().methods([])),
        InvalidIdempotencyOptions::NoMethods
    );
    assert_eq!(
        refuse(IdempotencyOptions::new().ttl(Duration::ZERO)),
        InvalidIdempotencyOptions::ZeroTtl
    );
    assert!(matches!(
        refuse(IdempotencyOptions::new().lock(Duration::from_secs(48 * 3600))),
        InvalidIdempotencyOptions::Lock { .. }
    ));
    assert_eq!(
        refuse(IdempotencyOptions::new().max_body(0)),
        InvalidIdempotencyOptions::ZeroMaxBody
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_keep_their_statuses() {
    let fx = fixture().await;
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .layer(IdempotencyLayer::new(fx.store.clone()));
    // No route: a 404 is not 5xx or 429, so it is stored, and the retry
    // gets it replayed, never a 500.
    let (s, _, _) = send(&app, post_req(Some("nowhere"), "{}")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, h, _) = send(&app, post_req(Some("nowhere"), "{}")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(h["idempotent-replayed"], "true");
    // A wrong method on a known route: 405, likewise.
    let (s, _, _) = send(
        &app,
        Request::post("/health")
            .header("idempotency-key", "m")
            .body(Body::empty())
            .expect("req"),
    )
    .await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
}

/// A handler that waits for `proceed`, counting runs and how many run at
/// once (a run that is dropped stops counting).
#[derive(Clone, Default)]
struct Runs {
    started: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    proceed: Arc<Notify>,
}

struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Runs {
    fn app(&self) -> Router {
        let runs = self.clone();
        Router::new().route(
            "/orders",
            post(move || {
                let runs = runs.clone();
                async move {
                    runs.started.fetch_add(1, Ordering::SeqCst);
                    let now = runs.running.fetch_add(1, Ordering::SeqCst) + 1;
                    let _running = Running(runs.running.clone());
                    runs.most_at_once.fetch_max(now, Ordering::SeqCst);
                    runs.entered.notify_one();
                    runs.proceed.notified().await;
                    (StatusCode::CREATED, "done")
                }
            }),
        )
    }
}

#[tokio::test]
async fn a_slow_request_keeps_its_key_past_the_lock() {
    let (store, _dir) = restarting_store(0).await;
    let runs = Runs::default();
    // A lock short enough to renew several times, long enough that a
    // renewal on a loaded machine still lands in time.
    let options = IdempotencyOptions::new().lock(Duration::from_millis(600));
    let app = runs
        .app()
        .layer(IdempotencyLayer::with_options(store.clone(), options).expect("options"));
    let began = tokio::time::Instant::now();
    let slow = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_req(Some("slow"), "{}")).await }
    });
    runs.entered.notified().await;
    tokio::time::sleep(Duration::from_millis(2400)).await;
    let (s, _, _) = send(&app, post_req(Some("slow"), "{}")).await;
    assert_eq!(s, StatusCode::CONFLICT, "four locks later, still its key");
    let renewals = store.renewals.load(Ordering::SeqCst);
    assert!(renewals >= 3, "it renewed");
    // A third of the lock apart at the closest, however busy the machine.
    let most = 2 + began.elapsed().as_millis() / 200;
    assert!(
        renewals as u128 <= most,
        "{renewals} renewals, more often than every 200 ms"
    );
    runs.proceed.notify_one();
    assert_eq!(slow.await.expect("task").0, StatusCode::CREATED);
    let (_, h, _) = send(&app, post_req(Some("slow"), "{}")).await;
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(runs.started.load(Ordering::SeqCst), 1);
}

/// A process cut off from the store (every renewal fails, its settles
/// hang) stops its handler before its lock passes; another process then
/// takes the key over within about one lock, and the two runs never
/// overlap.
#[tokio::test]
async fn a_key_whose_holder_is_cut_off_is_taken_over_and_runs_never_overlap() {
    let (mut cut_off, _dir) = restarting_store(0).await;
    cut_off.renewals_fail = true;
    cut_off.settles_hang = true;
    let runs = Runs::default();
    let lock = Duration::from_secs(1);
    let options = || IdempotencyOptions::new().lock(lock);
    let first = runs
        .app()
        .layer(IdempotencyLayer::with_options(cut_off.clone(), options()).expect("options"));
    let second = runs
        .app()
        .layer(IdempotencyLayer::with_options(cut_off.inner.clone(), options()).expect("options"));

    let began = tokio::time::Instant::now();
    let stopped = tokio::spawn({
        let first = first.clone();
        async move { send(&first, post_req(Some("cut"), "{}")).await }
    });
    runs.entered.notified().await;
    let (s, _, _) = send(&second, post_req(Some("cut"), "{}")).await;
    assert_eq!(s, StatusCode::CONFLICT, "the lock holds at first");

    let (status, headers, body) = stopped.await.expect("task");
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);
    assert!(began.elapsed() < lock, "stopped before its lock passed");
    assert_eq!(
        runs.running.load(Ordering::SeqCst),
        0,
        "its handler was dropped"
    );

    let retry = tokio::spawn({
        let second = second.clone();
        async move { answer_after_in_flight(&second, "cut", Duration::from_secs(5)).await }
    });
    runs.entered.notified().await;
    let taken_over = began.elapsed();
    runs.proceed.notify_one();
    assert_eq!(retry.await.expect("task").0, StatusCode::CREATED);
    // (The lock is kept in wall-clock milliseconds: allow for rounding.)
    assert!(
        taken_over >= lock.mul_f64(0.95),
        "not before the lock: {taken_over:?}"
    );
    assert!(taken_over < lock * 3, "within about a lock: {taken_over:?}");
    assert_eq!(runs.started.load(Ordering::SeqCst), 2);
    assert_eq!(
        runs.most_at_once.load(Ordering::SeqCst),
        1,
        "never two at once"
    );
}

/// The SQLite store, with its next `failures` settles (complete or release)
/// failing as if the database were restarting.
#[derive(Clone)]
struct RestartingStore {
    inner: SqliteStore,
    failures: Arc<AtomicUsize>,
    settles: Arc<AtomicUsize>,
    /// How long storing a response takes (a slow database).
    complete_delay: Duration,
    /// Lock renewals asked for.
    renewals: Arc<AtomicUsize>,
    /// Whether every renewal fails (the store unreachable from here).
    renewals_fail: bool,
    /// Whether every settle hangs (a write into a black hole).
    settles_hang: bool,
    /// Errors the next settles fail with, in order, before `failures`.
    scripted: Arc<parking_lot::Mutex<std::collections::VecDeque<StoreError>>>,
    /// Whether beginning a key fails (the store unreachable).
    begins_fail: bool,
}

impl RestartingStore {
    async fn settle(&self) -> Result<(), StoreError> {
        if self.settles_hang {
            std::future::pending::<()>().await;
        }
        self.settles.fetch_add(1, Ordering::SeqCst);
        if let Some(err) = self.scripted.lock().pop_front() {
            return Err(err);
        }
        let failing = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        match failing {
            Ok(_) => Err(StoreError::Unavailable("the database is restarting".into())),
            Err(_) => Ok(()),
        }
    }
}

#[async_trait::async_trait]
impl Store for RestartingStore {
    type Tx = <SqliteStore as Store>::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }
    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for RestartingStore {
    async fn idempotency_begin(
        &self,
        claim: &IdempotencyClaim<'_>,
    ) -> Result<IdempotencyBegin, StoreError> {
        if self.begins_fail {
            return Err(StoreError::Unavailable("the store is unreachable".into()));
        }
        self.inner.idempotency_begin(claim).await
    }
    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let renewals = self.renewals.fetch_add(1, Ordering::SeqCst) + 1;
        if self.renewals_fail {
            // A holder renewing without waiting would spin, and under
            // paused time never let the clock move: fail, not hang.
            assert!(renewals < 1000, "renewals do not wait between tries");
            return Err(StoreError::Unavailable("the store is unreachable".into()));
        }
        self.inner
            .idempotency_renew(principal, key, owner, locked_until)
            .await
    }
    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        tokio::time::sleep(self.complete_delay).await;
        self.settle().await?;
        self.inner
            .idempotency_complete(principal, key, owner, response)
            .await
    }
    async fn idempotency_complete_in(
        &self,
        tx: &mut Self::Tx,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.inner
            .idempotency_complete_in(tx, principal, key, owner, response)
            .await
    }
    async fn idempotency_release(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        self.settle().await?;
        self.inner.idempotency_release(principal, key, owner).await
    }
    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        self.inner.idempotency_prune(now, batch).await
    }
}

async fn restarting_store(failures: usize) -> (RestartingStore, TempDir) {
    let Fixture { store, _dir: dir } = fixture().await;
    let store = RestartingStore {
        inner: store,
        failures: Arc::new(AtomicUsize::new(failures)),
        settles: Arc::new(AtomicUsize::new(0)),
        complete_delay: Duration::ZERO,
        renewals: Arc::new(AtomicUsize::new(0)),
        renewals_fail: false,
        settles_hang: false,
        scripted: Arc::default(),
        begins_fail: false,
    };
    (store, dir)
}

/// Polls `key` until its answer is not `409`, for at most `within`.
async fn answer_after_in_flight(
    app: &Router,
    key: &str,
    within: Duration,
) -> (StatusCode, HeaderMap) {
    let until = tokio::time::Instant::now() + within;
    loop {
        let (status, headers, _) = send(app, post_req(Some(key), "{}")).await;
        if status != StatusCode::CONFLICT || tokio::time::Instant::now() >= until {
            return (status, headers);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client that hangs up while its response is being stored (here: the
/// request's future is dropped 50 ms into a 200 ms write) does not cut the
/// write: the key completes, and the retry replays instead of meeting `409`
/// until the lock passes, or running the handler again.
#[tokio::test]
async fn a_hang_up_while_the_response_is_stored_still_completes_the_key() {
    let (mut store, _dir) = restarting_store(0).await;
    store.complete_delay = Duration::from_millis(200);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(store.clone()));

    let cut = tokio::time::timeout(
        Duration::from_millis(50),
        send(&app, post_req(Some("hung-up"), "{}")),
    )
    .await;
    assert!(cut.is_err(), "the client hung up during the store write");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, headers, _) = send(&app, post_req(Some("hung-up"), "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true", "the stored answer");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// The handler ran but the store could not take its response: the client
/// gets `503` (the answer is withheld, not lost), and its retry, within
/// seconds, the response kept once the store was back.
#[tokio::test]
async fn a_response_the_store_could_not_take_is_stored_once_it_is_back() {
    let (store, _dir) = restarting_store(4).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(store.clone()));

    let (status, headers, body) = send(&app, post_req(Some("during-restart"), "{}")).await;
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));

    let (status, headers) =
        answer_after_in_flight(&app, "during-restart", Duration::from_secs(10)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(
        store.settles.load(Ordering::SeqCst),
        5,
        "4 failures, then stored"
    );
}

/// A holder whose response the store does not take (cut off from it) and
/// whose lock then passes: a retry elsewhere takes the key over and runs
/// again, and of the two runs exactly one answers fresh. The network-fault
/// test found the first run answering `201` too, with its key not settled.
#[tokio::test]
async fn a_key_taken_over_after_an_unconfirmed_response_has_one_fresh_answer() {
    let (mut cut_off, _dir) = restarting_store(usize::MAX).await;
    cut_off.renewals_fail = true;
    let lock = Duration::from_secs(1);
    let options = || IdempotencyOptions::new().lock(lock);
    let runs = Arc::new(AtomicUsize::new(0));
    let first = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(cut_off.clone(), options()).expect("options"));
    let second = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(cut_off.inner.clone(), options()).expect("options"));

    let (status, headers, body) = send(&first, post_req(Some("cut"), "{}")).await;
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);

    let (status, headers) = answer_after_in_flight(&second, "cut", Duration::from_secs(5)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(
        !headers.contains_key("idempotent-replayed"),
        "the one fresh answer"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "taken over after the lock");
    let (_, headers, _) = send(&second, post_req(Some("cut"), "{}")).await;
    assert_eq!(headers["idempotent-replayed"], "true");
}

#[tokio::test]
async fn a_release_the_store_could_not_take_is_retried_so_the_retry_runs() {
    let (store, _dir) = restarting_store(2).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders",
            post({
                let runs = runs.clone();
                move || async move {
                    match runs.fetch_add(1, Ordering::SeqCst) {
                        0 => StatusCode::SERVICE_UNAVAILABLE,
                        _ => StatusCode::CREATED,
                    }
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()));

    let (status, _, _) = send(&app, post_req(Some("retry-me"), "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _) = answer_after_in_flight(&app, "retry-me", Duration::from_secs(10)).await;
    assert_eq!(status, StatusCode::CREATED, "released, so the retry ran");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn settling_stops_after_five_minutes() {
    // The jitter is drawn on this thread: the same waits on every run.
    fastrand::seed(7);
    let (store, _dir) = restarting_store(usize::MAX).await;
    let app =
        counting_app(Arc::new(AtomicUsize::new(0))).layer(IdempotencyLayer::new(store.clone()));
    let (status, _, _) = send(&app, post_req(Some("down-for-good"), "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "not recorded");
    // From here only failing settles run, none touching SQLite (whose pool
    // would time out under paused time).
    tokio::time::pause();

    // With the store down for good the tries go on for five minutes (a
    // late write is safe: the store takes it only from the key's owner),
    // then stop, so no task per request outlives the outage forever.
    tokio::time::sleep(Duration::from_secs(4 * 60)).await;
    let tries = store.settles.load(Ordering::SeqCst);
    assert!(tries > 40, "it kept trying: {tries}");
    tokio::time::sleep(Duration::from_secs(60)).await;
    let last = store.settles.load(Ordering::SeqCst);
    // Waits double from 100 ms to at most 5 s, each jittered to between
    // half and all of itself: some 80 tries in five minutes, and never
    // more than 126 (every wait at its shortest).
    assert!(
        (70..=126).contains(&last),
        "backoff with jitter: {last} tries"
    );
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    assert_eq!(
        store.settles.load(Ordering::SeqCst),
        last,
        "no try after five minutes"
    );
}

/// A holder whose renewals fail tries again every 250 ms from a third of
/// its lock, and stops its handler (`503`) only once the next try could not
/// land a fifth of the lock before it passes: with a 30 s lock, renewals at
/// 10 s, 10.25 s, ... 23.75 s (56 tries), then stopped, before 24 s.
///
/// Time is paused once the handler runs; the lock was taken a moment of
/// real time before, so the checks leave seconds for that moment (a busy
/// machine) and count the tries only at the end, where it cannot matter.
#[tokio::test]
async fn failing_renewals_are_tried_again_until_a_fifth_of_the_lock_is_left() {
    let (mut store, _dir) = restarting_store(usize::MAX).await;
    store.renewals_fail = true;
    let runs = Runs::default();
    let lock = Duration::from_secs(30);
    let options = IdempotencyOptions::new().lock(lock);
    let app = runs
        .app()
        .layer(IdempotencyLayer::with_options(store.clone(), options).expect("options"));
    let holder = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_req(Some("renew"), "{}")).await }
    });
    runs.entered.notified().await;
    // From here nothing touches SQLite: renewals and settles fail first.
    tokio::time::pause();
    let paused = tokio::time::Instant::now();

    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        0,
        "not renewed before a third of the lock"
    );
    tokio::time::sleep_until(paused + Duration::from_secs(16)).await;
    assert!(store.renewals.load(Ordering::SeqCst) >= 1, "renewing");
    assert!(
        !holder.is_finished(),
        "a failed renewal with time left does not stop the handler"
    );

    let (status, headers, body) = holder.await.expect("task");
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        paused.elapsed() < lock.mul_f64(0.8),
        "stopped a fifth of the lock before it passes: {:?}",
        paused.elapsed()
    );
    assert_eq!(
        store.renewals.load(Ordering::SeqCst),
        56,
        "10 s, then every 250 ms while one more could land before 24 s"
    );
    assert_eq!(
        runs.running.load(Ordering::SeqCst),
        0,
        "its handler was dropped"
    );
}

/// A settle that failed in a way not worth retrying (here the store's
/// `Other`) is given up at once: no try in the background, the failure
/// counted, and the key left to its lock.
#[tokio::test]
async fn a_settle_failing_for_good_is_not_tried_again() {
    let metrics = MetricsRecorder::global();
    let (store, _dir) = restarting_store(0).await;
    store
        .scripted
        .lock()
        .push_back(StoreError::Other("a constraint failed".into()));
    let app =
        counting_app(Arc::new(AtomicUsize::new(0))).layer(IdempotencyLayer::new(store.clone()));
    let (status, headers, body) = send(&app, post_req(Some("broken"), "{}")).await;
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);
    // From here nothing may touch SQLite (its pool times out when paused).
    tokio::time::pause();
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    assert_eq!(store.settles.load(Ordering::SeqCst), 1, "not tried again");
    assert_eq!(
        metrics.counter("keel_idempotency_store_errors_total"),
        1,
        "the failure is counted"
    );
    assert_eq!(metrics.counter("keel_idempotency_settle_retried_total"), 0);
}

/// A settle tried again in the background stops at the first error not
/// worth retrying.
#[tokio::test]
async fn settling_in_the_background_stops_at_an_error_for_good() {
    let (store, _dir) = restarting_store(0).await;
    store.scripted.lock().extend([
        StoreError::Unavailable("the database is restarting".into()),
        StoreError::Other("a constraint failed".into()),
    ]);
    let app =
        counting_app(Arc::new(AtomicUsize::new(0))).layer(IdempotencyLayer::new(store.clone()));
    let (status, _, _) = send(&app, post_req(Some("broken-later"), "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::pause();
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    assert_eq!(
        store.settles.load(Ordering::SeqCst),
        2,
        "tried once more, then given up"
    );
}

/// A response stored on a later try whose key is not found is done: an
/// earlier try whose outcome was unknown committed, or a retry took the key
/// over. It counts as stored on a later try, not as a failure.
#[tokio::test]
async fn a_later_complete_finding_no_key_is_done() {
    let metrics = MetricsRecorder::global();
    let (store, _dir) = restarting_store(0).await;
    store.scripted.lock().extend([
        StoreError::OutcomeUnknown("the commit's answer was lost".into()),
        StoreError::NotFound("no such key in flight".into()),
    ]);
    let app =
        counting_app(Arc::new(AtomicUsize::new(0))).layer(IdempotencyLayer::new(store.clone()));
    let (status, _, _) = send(&app, post_req(Some("done-already"), "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::pause();
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    assert_eq!(store.settles.load(Ordering::SeqCst), 2);
    assert_eq!(metrics.counter("keel_idempotency_settle_retried_total"), 1);
    assert_eq!(
        metrics.counter("keel_idempotency_store_errors_total"),
        1,
        "only the first try failed"
    );
}

/// A release tried again whose key is not found is not counted as done: it
/// is given up as a failure.
#[tokio::test]
async fn a_later_release_finding_no_key_is_a_failure() {
    let metrics = MetricsRecorder::global();
    let (store, _dir) = restarting_store(0).await;
    store.scripted.lock().extend([
        StoreError::Unavailable("the database is restarting".into()),
        StoreError::NotFound("no such key in flight".into()),
    ]);
    let app = Router::new()
        .route("/orders", post(|| async { StatusCode::BAD_GATEWAY }))
        .layer(IdempotencyLayer::new(store.clone()));
    let (status, _, _) = send(&app, post_req(Some("gone"), "{}")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    tokio::time::pause();
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    assert_eq!(store.settles.load(Ordering::SeqCst), 2);
    assert_eq!(metrics.counter("keel_idempotency_settle_retried_total"), 0);
    assert_eq!(metrics.counter("keel_idempotency_store_errors_total"), 2);
}

/// A store that cannot begin a key answers `503`, and the handler does not
/// run.
#[tokio::test]
async fn a_store_that_cannot_begin_a_key_is_503() {
    let (mut store, _dir) = restarting_store(0).await;
    store.begins_fail = true;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(store.clone()));
    let (status, headers, body) = send(&app, post_req(Some("unreachable"), "{}")).await;
    assert_problem(status, &headers, &body, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A response exactly at the stored-body limit is stored whole.
#[tokio::test]
async fn a_response_at_the_store_limit_replays_with_its_body() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    // `{"run":1,"who":"nobody","bytes":2}`: 34 bytes.
    let options = IdempotencyOptions::new().max_response_body(34);
    let app = counting_app(runs.clone())
        .layer(IdempotencyLayer::with_options(fx.store.clone(), options).expect("options"));
    let (_, _, live) = send(&app, post_req(Some("at-limit"), "{}")).await;
    assert_eq!(live.len(), 34);
    let (s, h, b) = send(&app, post_req(Some("at-limit"), "{}")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(h["idempotent-replayed"], "true");
    assert!(h.get("idempotent-body-omitted").is_none());
    assert_eq!(b, live);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A request body that breaks off while it is read is `400`, not `413`,
/// and the handler does not run.
#[tokio::test]
async fn a_body_that_breaks_off_is_400() {
    let fx = fixture().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(runs.clone()).layer(IdempotencyLayer::new(fx.store.clone()));
    let chunks = futures_util::stream::iter([
        Ok(Bytes::from_static(b"{")),
        Err(std::io::Error::other("connection reset")),
    ]);
    let request = Request::post("/orders")
        .header("idempotency-key", "broken-body")
        .body(Body::from_stream(chunks))
        .expect("request");
    let (s, h, b) = send(&app, request).await;
    assert_problem(s, &h, &b, StatusCode::BAD_REQUEST);
    let problem: serde_json::Value = serde_json::from_slice(&b).expect("problem json");
    assert_eq!(
        problem["type"], "urn:keel:problem:idempotency:unreadable_body",
        "the problem type names the refusal"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A key released because its handler failed is released before the answer
/// goes out, not later in the background.
#[tokio::test]
async fn a_key_is_released_before_the_answer_goes_out() {
    let (store, _dir) = restarting_store(0).await;
    let app = Router::new()
        .route("/orders", post(|| async { StatusCode::BAD_GATEWAY }))
        .layer(IdempotencyLayer::new(store.clone()));
    let (status, _, _) = send(&app, post_req(Some("released"), "{}")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        store.settles.load(Ordering::SeqCst),
        1,
        "released before the answer"
    );
}

/// A service not ready (here: failing readiness, as a load shedder does)
/// is not ready behind the layer either.
#[tokio::test]
async fn the_layer_is_ready_only_when_its_service_is() {
    #[derive(Clone)]
    struct Overloaded;
    impl tower::Service<Request<Body>> for Overloaded {
        type Response = axum::response::Response;
        type Error = &'static str;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Err("overloaded"))
        }
        fn call(&mut self, _: Request<Body>) -> Self::Future {
            std::future::ready(Ok(axum::response::Response::new(Body::empty())))
        }
    }
    let fx = fixture().await;
    let mut service = tower::Layer::layer(&IdempotencyLayer::new(fx.store.clone()), Overloaded);
    let ready = ServiceExt::<Request<Body>>::ready(&mut service)
        .await
        .map(|_| ());
    assert_eq!(ready, Err("overloaded"));
}

// ------------------------------------------------- completed in the handler --

/// A shop on `store`: an `orders` table, and the handler context.
#[derive(Clone)]
struct Shop {
    store: RestartingStore,
    runs: Arc<AtomicUsize>,
}

impl Shop {
    async fn open(store: RestartingStore) -> Self {
        let mut tx = store.begin().await.expect("begin");
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .execute(&mut *tx)
            .await
            .expect("orders table");
        store.commit(tx).await.expect("commit");
        Self {
            store,
            runs: Arc::default(),
        }
    }

    /// `POST /orders` behind the layer (lock `lock`), running `handler`.
    fn app<H, T>(&self, lock: Duration, handler: H) -> Router
    where
        H: axum::handler::Handler<T, Shop>,
        T: 'static,
    {
        let layer = IdempotencyLayer::with_options(
            self.store.clone(),
            IdempotencyOptions::new().lock(lock),
        )
        .expect("options");
        Router::new()
            .route("/orders", post(handler).layer(layer))
            .with_state(self.clone())
    }

    async fn orders(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(self.store.inner.pool())
            .await
            .expect("count orders")
    }

    /// The layer's own completes and releases.
    fn layer_settles(&self) -> usize {
        self.store.settles.load(Ordering::SeqCst)
    }

    /// Inserts an order and, in the same transaction, completes the key
    /// with `201`; waits `linger` after the commit before answering.
    async fn place(&self, held: &HeldKey, body: Bytes, linger: Duration) -> Response {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let mut tx = self.store.begin().await.expect("begin");
        sqlx::query("INSERT INTO orders (body) VALUES ($1)")
            .bind(String::from_utf8_lossy(&body).into_owned())
            .execute(&mut *tx)
            .await
            .expect("insert");
        let response = (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/orders/{run}"))],
            format!("order {run} for {}", held.key()),
        );
        let completion = held
            .complete_in(&self.store, &mut tx, response)
            .await
            .expect("complete in the transaction");
        self.store.commit(tx).await.expect("commit");
        tokio::time::sleep(linger).await;
        completion.committed()
    }
}

/// A handler that completes its key in its own transaction
/// ([`HeldKey::complete_in`]): the layer writes nothing after it.
#[tokio::test]
async fn the_key_completes_with_the_handlers_commit_and_the_layer_writes_nothing() {
    let (store, _dir) = restarting_store(0).await;
    let shop = Shop::open(store).await;
    let app = shop.app(
        Duration::from_secs(10),
        |State(shop): State<Shop>, held: HeldKey, body: Bytes| async move {
            shop.place(&held, body, Duration::ZERO).await
        },
    );
    let (status, headers, body) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(&body[..], b"order 1 for k-1");

    let (again, replay_headers, replayed) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(replay_headers["idempotent-replayed"], "true");
    assert_eq!(replay_headers[header::LOCATION], "/orders/1");
    assert_eq!(
        replayed, body,
        "the replay is the first answer, byte for byte"
    );
    assert_eq!(shop.runs.load(Ordering::SeqCst), 1);
    assert_eq!(shop.orders().await, 1);
    assert_eq!(shop.layer_settles(), 0);
}

/// The layer renews the lock every third of it; a renewal after the
/// handler's commit no longer finds the key in flight. That is the
/// handler's own completion, not a takeover: the handler is not stopped.
#[tokio::test]
async fn a_renewal_after_the_commit_does_not_stop_the_handler() {
    let (store, _dir) = restarting_store(0).await;
    let shop = Shop::open(store).await;
    let lock = Duration::from_millis(300);
    let app = shop.app(
        lock,
        move |State(shop): State<Shop>, held: HeldKey, body: Bytes| async move {
            shop.place(&held, body, lock * 2).await
        },
    );
    let (status, _, body) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(shop.store.renewals.load(Ordering::SeqCst) >= 1, "renewed");
    assert_eq!(shop.layer_settles(), 0);
}

/// A completion whose transaction rolled back stored nothing: the layer
/// settles the key as for any handler, releasing it on a `503` (the retry
/// runs again) and storing a `422` (replayed).
#[tokio::test]
async fn a_completion_rolled_back_leaves_the_key_to_the_layer() {
    let (store, _dir) = restarting_store(0).await;
    let shop = Shop::open(store).await;
    let answer = Arc::new(parking_lot::Mutex::new(StatusCode::SERVICE_UNAVAILABLE));
    let app = {
        let answer = Arc::clone(&answer);
        shop.app(
            Duration::from_secs(10),
            move |State(shop): State<Shop>, held: HeldKey| async move {
                shop.runs.fetch_add(1, Ordering::SeqCst);
                let mut tx = shop.store.begin().await.expect("begin");
                let completion = held
                    .complete_in(&shop.store, &mut tx, StatusCode::CREATED)
                    .await
                    .expect("complete in the transaction");
                shop.store.rollback(tx).await.expect("rollback");
                drop(completion);
                let status = *answer.lock();
                status.into_response()
            },
        )
    };
    let (first, ..) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE);
    *answer.lock() = StatusCode::UNPROCESSABLE_ENTITY;
    let (second, headers, _) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(
        second,
        StatusCode::UNPROCESSABLE_ENTITY,
        "released: ran again"
    );
    assert!(!headers.contains_key("idempotent-replayed"));
    let (third, headers, _) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(third, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(shop.runs.load(Ordering::SeqCst), 2);
    // One release, one complete: both by the layer.
    assert_eq!(shop.layer_settles(), 2);
}

#[tokio::test]
async fn a_route_outside_the_layer_has_no_held_key() {
    let app =
        Router::new()
            .route("/orders", post(|_: HeldKey| async { StatusCode::CREATED }))
            .route(
                "/maybe",
                post(|held: Option<HeldKey>| async move {
                    format!("{}", held.is_some()).into_response()
                }),
            );
    let (status, headers, _) = send(&app, post_req(Some("k-1"), "tea")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let maybe = Request::post("/maybe")
        .body(Body::empty())
        .expect("request");
    let (status, _, body) = send(&app, maybe).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"false"[..]));
}
