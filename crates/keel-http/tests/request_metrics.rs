//! RED metrics per route: each request is counted under its route
//! template, method and status class; an unmatched path or an odd method
//! cannot mint new series; a caller that goes away is counted `dropped`
//! and leaves nothing in flight.
#![cfg(feature = "request-metrics")]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::routing::get;
use keel_http::request_metrics::RequestMetricsLayer;
use keel_testkit::metrics::MetricsRecorder;
use tower::ServiceExt;

fn app() -> Router {
    Router::new()
        .route("/orders/{id}", get(|| async { "an order" }))
        .route(
            "/broken",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .route("/slow", get(std::future::pending::<&'static str>))
        .layer(RequestMetricsLayer::new())
}

async fn send(method: Method, path: &str) -> StatusCode {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    app().oneshot(request).await.unwrap().status()
}

#[tokio::test]
async fn requests_are_counted_by_route_template_method_and_status_class() {
    let m = MetricsRecorder::global();
    for id in ["A-1", "A-2", "A-3"] {
        assert_eq!(
            send(Method::GET, &format!("/orders/{id}")).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(Method::GET, "/broken").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        send(Method::POST, "/orders/A-1").await,
        StatusCode::METHOD_NOT_ALLOWED
    );
    for path in ["/nope", "/orders", "/../../etc/passwd"] {
        assert_eq!(send(Method::GET, path).await, StatusCode::NOT_FOUND);
    }
    let odd = Method::from_bytes(b"BREW").unwrap();
    send(odd, "/orders/A-1").await;

    let total = |labels: &str| m.counter(&format!("keel_http_requests_total,{labels}"));
    assert_eq!(
        total("method=GET,route=/orders/{id},status=2xx"),
        3,
        "one series for every id"
    );
    assert_eq!(total("method=GET,route=/broken,status=5xx"), 1);
    assert_eq!(total("method=POST,route=/orders/{id},status=4xx"), 1);
    assert_eq!(
        total("method=GET,route=unmatched,status=4xx"),
        3,
        "no series per unknown path"
    );
    assert_eq!(
        total("method=other,route=/orders/{id},status=4xx"),
        1,
        "no series per odd method"
    );
    assert_eq!(
        m.sum("keel_http_requests_total", "method="),
        9,
        "every request once"
    );
    assert_eq!(
        m.gauge("keel_http_requests_in_flight,method=GET,route=/orders/{id}"),
        0.0
    );
}

#[tokio::test]
async fn a_caller_that_goes_away_is_counted_dropped_and_leaves_nothing_in_flight() {
    let m = MetricsRecorder::global();
    let request = Request::builder().uri("/slow").body(Body::empty()).unwrap();
    let mut call = Box::pin(app().oneshot(request));
    // Started, then abandoned: the handler never answers.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut call)
            .await
            .is_err()
    );
    assert_eq!(
        m.gauge("keel_http_requests_in_flight,method=GET,route=/slow"),
        1.0,
        "in flight while it runs"
    );
    drop(call);
    assert_eq!(
        m.counter("keel_http_requests_total,method=GET,route=/slow,status=dropped"),
        1
    );
    assert_eq!(
        m.gauge("keel_http_requests_in_flight,method=GET,route=/slow"),
        0.0
    );
}
