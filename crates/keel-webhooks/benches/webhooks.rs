//! Webhook benchmarks: signing and verifying, and end-to-end deliveries to
//! a loopback receiver (claim from SQLite, sign, POST, record the attempt).
//!
//! `cargo bench -p keel-webhooks --bench webhooks`

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use keel_sqlite::SqliteStore;
use keel_store::Store;
use keel_webhooks::signing::{Secret, SignatureScheme, Verifier, signature_headers};
use keel_webhooks::ssrf::SsrfGuard;
use keel_webhooks::{
    DeliveryWorker, Endpoints, NewEndpoint, WebhookEvent, WebhookOutbox, WorkerOptions,
};
use tokio::net::TcpListener;

fn signing(c: &mut Criterion) {
    let old = Secret::generate().expect("secret");
    let new = Secret::generate().expect("secret");
    let body = vec![b'x'; 1024];
    let mut group = c.benchmark_group("webhooks/signing");
    group.throughput(Throughput::Elements(1));
    group.bench_function("sign_1KiB_two_secrets", |b| {
        b.iter(|| {
            signature_headers(
                &SignatureScheme::StandardWebhooks,
                [&old, &new],
                black_box("evt_0190f5c46a1e7b2c"),
                1_700_000_000,
                black_box(&body),
            )
        })
    });
    let mut headers = HeaderMap::new();
    for (name, value) in signature_headers(
        &SignatureScheme::default(),
        [&new],
        "evt_1",
        1_700_000_000,
        &body,
    )
    .expect("sign")
    {
        headers.insert(name, value);
    }
    let verifier = Verifier::new([old.clone(), new.clone()]);
    group.bench_function("verify_1KiB_two_secrets", |b| {
        b.iter(|| verifier.verify(black_box(&headers), black_box(&body), 1_700_000_010))
    });
    group.finish();
}

/// A loopback receiver that counts requests and answers `200`.
async fn receiver() -> (Arc<AtomicUsize>, SocketAddr) {
    let hits = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let counter = Arc::clone(&hits);
    let app = Router::new().fallback(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        async { "ok" }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (hits, addr)
}

fn deliveries(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("webhooks/deliver");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));
    for endpoints in [1usize, 4] {
        group.bench_function(format!("loopback_{endpoints}_endpoints"), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                let dir = tempfile::tempdir().expect("temp dir");
                let store = SqliteStore::open(dir.path().join("keel.db"))
                    .await
                    .expect("open");
                let guard = SsrfGuard::new().allow("127.0.0.1/32".parse().expect("net"));
                let (hits, addr) = receiver().await;
                let manage = Endpoints::new(store.clone(), guard.clone());
                for i in 0..endpoints {
                    manage
                        .create(NewEndpoint::new(format!("http://{addr}/e{i}")))
                        .await
                        .expect("endpoint");
                }
                let per_endpoint = (iters as usize).div_ceil(endpoints).max(1);
                let outbox = WebhookOutbox::new(store.clone());
                let events: Vec<_> = (0..per_endpoint)
                    .map(|i| WebhookEvent::new("bench.event", serde_json::json!({ "n": i })))
                    .collect();
                for chunk in events.chunks(1000) {
                    let mut tx = store.begin().await.expect("begin");
                    outbox.enqueue(&mut tx, chunk).await.expect("enqueue");
                    store.commit(tx).await.expect("commit");
                }
                let total = per_endpoint * endpoints;
                let worker = DeliveryWorker::new(
                    store.clone(),
                    WorkerOptions::new()
                        .guard(guard)
                        .per_endpoint(256)
                        .batch(256)
                        .max_in_flight(512)
                        .poll_interval(Duration::from_millis(2)),
                )
                .expect("worker");
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let started = tokio::time::Instant::now();
                let running = worker.spawn(async move {
                    let _ = stopped.await;
                });
                while hits.load(Ordering::Relaxed) < total {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let elapsed = started.elapsed();
                let _ = stop.send(());
                let _ = running.await;
                // Per requested iteration (a few extra may have been sent).
                elapsed.mul_f64(iters as f64 / total as f64)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, signing, deliveries);
criterion_main!(benches);
