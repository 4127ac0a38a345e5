//! What the edge layers cost per request, in process (`oneshot`), beside
//! the bare handler and tower's nearest layers in the same run:
//!
//! - `deadline`: [`DeadlineLayer`] (reads the header, caps it, runs the
//!   handler inside the deadline's scope) vs tower's `Timeout`;
//! - `trace`: [`TraceContextLayer`] (parses `traceparent`, opens a span,
//!   answers `traceresponse`), which tower has no counterpart for;
//! - `shed`: [`HttpLoadShedLayer`] with a free slot vs tower's
//!   `load_shed` + `concurrency_limit` (the 503 needs axum's
//!   `HandleErrorLayer` there);
//! - `observe`: [`RequestMetricsLayer`] with the Prometheus recorder
//!   `keel serve` installs, and [`ExperimentLayer`] enabled, for a request
//!   in no experiment (what every production request pays); tower has no
//!   counterpart for either.
//!
//! Run: `cargo bench -p keel-http --features propagation,shed,request-metrics,chaos --bench edge_layers`

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use criterion::{Criterion, criterion_group, criterion_main};
use keel_core::clock;
use keel_core::deadline::DEADLINE_HEADER;
use keel_http::experiment::ExperimentLayer;
use keel_http::propagation::{DeadlineLayer, TraceContextLayer};
use keel_http::request_metrics::RequestMetricsLayer;
use keel_http::shed::HttpLoadShedLayer;
use keel_policy::shed::LoadShed;
use tower::{ServiceBuilder, ServiceExt};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn bare() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

fn request() -> Request<Body> {
    Request::get("/")
        .header("traceparent", TRACEPARENT)
        .header(
            DEADLINE_HEADER,
            (clock::unix_millis() + 3_600_000).to_string(),
        )
        .body(Body::empty())
        .expect("request")
}

fn bench_group(c: &mut Criterion, name: &str, routers: Vec<(&str, Router)>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group(name);
    for (label, router) in routers {
        group.bench_function(label, |b| {
            b.to_async(&runtime).iter(|| {
                let router = router.clone();
                async move {
                    let response = router.oneshot(request()).await.expect("infallible");
                    assert_eq!(response.status(), StatusCode::OK);
                }
            });
        });
    }
    group.finish();
}

fn deadline(c: &mut Criterion) {
    let tower_timeout = bare().layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|_| async {
                StatusCode::GATEWAY_TIMEOUT
            }))
            .timeout(Duration::from_secs(30)),
    );
    let routers = vec![
        ("bare", bare()),
        ("keel_deadline_layer", bare().layer(DeadlineLayer::new())),
        ("tower_timeout", tower_timeout),
    ];
    bench_group(c, "deadline", routers);
}

fn trace(c: &mut Criterion) {
    let routers = vec![
        ("bare", bare()),
        (
            "keel_trace_context_layer",
            bare().layer(TraceContextLayer::new()),
        ),
    ];
    bench_group(c, "trace", routers);
}

fn shed(c: &mut Criterion) {
    let keel = HttpLoadShedLayer::new(LoadShed::builder("bench").build().expect("shed"));
    let tower_shed = bare().layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|_| async {
                StatusCode::SERVICE_UNAVAILABLE
            }))
            .load_shed()
            .concurrency_limit(1024),
    );
    let routers = vec![
        ("bare", bare()),
        ("keel_http_load_shed_layer", bare().layer(keel)),
        ("tower_load_shed_concurrency_limit", tower_shed),
    ];
    bench_group(c, "shed", routers);
}

fn observe(c: &mut Criterion) {
    // As `keel serve` installs it: latency as a histogram with buckets.
    let buckets = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    let _ = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(
                "keel_http_request_duration_seconds".to_owned(),
            ),
            &buckets,
        )
        .and_then(|builder| builder.install_recorder());
    let routers = vec![
        ("bare", bare()),
        (
            "keel_request_metrics_layer",
            bare().layer(RequestMetricsLayer::new()),
        ),
        (
            "keel_experiment_layer_no_experiment",
            bare().layer(ExperimentLayer::builder().enabled(true).build()),
        ),
    ];
    bench_group(c, "observe", routers);
}

criterion_group!(benches, deadline, trace, shed, observe);
criterion_main!(benches);
