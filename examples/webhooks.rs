//! Webhooks, both halves: queue signed deliveries in the business
//! transaction, send them from a worker, and verify, dedupe and hand them
//! on in the receiving service.
//!
//! The sender never calls the customer from the request that caused the
//! event: the delivery is a row written in the same transaction, and a
//! worker signs it (Standard Webhooks: HMAC-SHA256 over id, timestamp and
//! raw body) and POSTs it, retrying over hours with backoff. The receiver
//! checks the signature on the raw bytes in constant time, refuses stale
//! timestamps and forgeries, and hands each event on once: a resend of a
//! delivered event is answered `2xx` without a second hand-off.
//!
//! Endpoint URLs pass an SSRF guard that refuses private and loopback
//! addresses; this example allows 127.0.0.1 explicitly, because its
//! receiver runs on loopback.
//!
//! Run: `cargo run -p keel-examples --example webhooks`

use std::time::Duration;

use axum::Router;
use keel_sqlite::SqliteStore;
use keel_store::Store;
use keel_webhooks::signing::Secret;
use keel_webhooks::ssrf::SsrfGuard;
use keel_webhooks::{
    DeliveryWorker, Endpoints, NewEndpoint, WebhookEvent, WebhookOutbox, WebhookReceiver,
    WorkerOptions,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    // The receiving service: verify, dedupe, hand off to a queue.
    let secret = Secret::generate()?;
    let (queue, mut received) = tokio::sync::mpsc::channel(16);
    let receiver = WebhookReceiver::new([secret.clone()]);
    let app: Router = Router::new().route("/webhooks", receiver.channel_route(queue));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hook_url = format!("http://{}/webhooks", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The sending service: an endpoint subscribed to order events.
    let store = SqliteStore::open_in_memory().await?;
    let guard = SsrfGuard::new().allow("127.0.0.1/32".parse()?);
    let endpoints = Endpoints::new(store.clone(), guard.clone());
    let new = NewEndpoint::new(&hook_url)
        .event_types(["order.paid"])
        .secret(secret);
    let (endpoint, _secret) = endpoints.create(new).await?;

    // In the business transaction: one delivery row per subscribed endpoint.
    let outbox = WebhookOutbox::new(store.clone());
    let mut tx = store.begin().await?;
    let paid = WebhookEvent::new("order.paid", serde_json::json!({"orderId": "A-4471"}))
        .with_id("evt_A-4471_paid");
    let queued = outbox.enqueue(&mut tx, &[paid]).await?;
    store.commit(tx).await?;
    println!("queued {queued} delivery for endpoint {}", endpoint.id);

    let worker = DeliveryWorker::new(store.clone(), WorkerOptions::new().guard(guard))?;
    let report = worker.run_once().await?;
    println!(
        "worker: {} attempted, {} succeeded",
        report.attempted, report.succeeded
    );
    let event = tokio::time::timeout(Duration::from_secs(5), received.recv())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the receiver closed"))?;
    println!(
        "received {} (verified): {}",
        event.id, event.payload["data"]
    );

    // A resend (a retry after a lost 2xx): answered, not handed off again.
    let deliveries = endpoints.deliveries(&Default::default()).await?;
    endpoints.resend(deliveries[0].id).await?;
    worker.run_once().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    anyhow::ensure!(received.try_recv().is_err(), "a duplicate was handed off");
    println!("resend: acknowledged, not handed off twice");

    // A forgery: the right shape, the wrong key.
    let forged = reqwest::Client::new()
        .post(&hook_url)
        .header("webhook-id", "evt_forged")
        .header(
            "webhook-timestamp",
            keel_core::clock::unix_seconds().to_string(),
        )
        .header("webhook-signature", "v1,bm90IGEgc2lnbmF0dXJl")
        .body(r#"{"type":"order.paid"}"#)
        .send()
        .await?;
    println!("forged request: {}", forged.status());
    anyhow::ensure!(
        forged.status().is_client_error(),
        "a forgery must be refused"
    );
    Ok(())
}

keel_examples::runs_to_the_end_test!();
