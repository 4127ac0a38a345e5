//! The Idempotency-Key layer's overhead: the same handler with and without
//! the layer, called in-process (`oneshot`), with the key store in memory
//! and on a temporary file (WAL, `synchronous = FULL`, so every new key
//! pays two fsynced commits: begin and complete).
//!
//! Run: `cargo bench -p keel-http --no-default-features --features idempotency --bench idempotency`

use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use criterion::{Criterion, criterion_group, criterion_main};
use keel_http::idempotency::IdempotencyLayer;
use keel_sqlite::SqliteStore;
use tower::ServiceExt;

const BODY: &str = r#"{"sku":"tea","quantity":2,"customer":"c-17"}"#;

fn handler_router() -> Router {
    Router::new().route(
        "/orders",
        post(|body: String| async move {
            (
                StatusCode::CREATED,
                [("content-type", "application/json")],
                format!(r#"{{"id":"A-4471","echo":{}}}"#, body.len()),
            )
        }),
    )
}

fn request(key: &str) -> Request<Body> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(BODY))
        .expect("request")
}

async fn call(app: &Router, key: &str) {
    let response = app.clone().oneshot(request(key)).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    let _ = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let (memory, file) = rt.block_on(async {
        (
            SqliteStore::open_in_memory().await.expect("memory store"),
            SqliteStore::open(dir.path().join("bench.db"))
                .await
                .expect("file store"),
        )
    });

    let mut group = c.benchmark_group("idempotency");
    let bare = handler_router();
    group.bench_function("without_layer", |b| {
        b.to_async(&rt).iter(|| call(&bare, "k"));
    });

    for (name, store) in [("memory", memory), ("file", file)] {
        let app = handler_router().layer(IdempotencyLayer::new(store));
        let counter = AtomicU64::new(0);
        group.bench_function(format!("{name}/new_key"), |b| {
            b.to_async(&rt).iter(|| {
                let key = format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));
                let app = app.clone();
                async move { call(&app, &key).await }
            });
        });
        rt.block_on(call(&app, "replayed-key"));
        group.bench_function(format!("{name}/replay"), |b| {
            b.to_async(&rt).iter(|| call(&app, "replayed-key"));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
