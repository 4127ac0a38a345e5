//! `Idempotency-Key` on an axum route: a retried `POST` gets the first
//! answer again instead of placing a second order.
//!
//! The handler counts how often it really runs. The client sends an order,
//! "loses" the response and retries with the same key: the layer replays
//! the stored answer (`Idempotent-Replayed: true`) and the handler ran once.
//! The same key with a different body is a `422` problem; a new key runs
//! the handler again. Keys live in the store (SQLite here), so a replay
//! survives a restart and works across processes sharing the database.
//!
//! Run: `cargo run -p keel-examples --example idempotency_keys`

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use keel_http::idempotency::IdempotencyLayer;
use keel_sqlite::SqliteStore;

/// Places an order; the counter stands for the side effect (a charge).
async fn place_order(
    State(runs): State<Arc<AtomicU32>>,
    Json(order): Json<serde_json::Value>,
) -> (StatusCode, Json<serde_json::Value>) {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let placed = serde_json::json!({"order": format!("A-{n:04}"), "sku": order["sku"]});
    (StatusCode::CREATED, Json(placed))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    let store = SqliteStore::open_in_memory().await?;
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route("/orders", post(place_order))
        .with_state(runs.clone())
        .layer(IdempotencyLayer::new(store));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/orders", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = reqwest::Client::new();
    let send = |key: &'static str, sku: &'static str| {
        client
            .post(&url)
            .header("idempotency-key", key)
            .json(&serde_json::json!({"sku": sku}))
            .send()
    };
    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let first = send(key, "tea").await?;
    println!("first:  {} {}", first.status(), first.text().await?);

    let retry = send(key, "tea").await?;
    let replayed = retry.headers().contains_key("idempotent-replayed");
    println!(
        "retry:  {} replayed={replayed} {}",
        retry.status(),
        retry.text().await?
    );

    let other_body = send(key, "coffee").await?;
    println!("same key, other body: {}", other_body.status());
    anyhow::ensure!(other_body.status() == StatusCode::UNPROCESSABLE_ENTITY);

    let new_key = send("0b3c41f2-98a1-4c4e-9a43-1f2d9a6c1e55", "coffee").await?;
    println!("new key: {} {}", new_key.status(), new_key.text().await?);

    let ran = runs.load(Ordering::SeqCst);
    println!("the handler ran {ran} times for 4 requests");
    anyhow::ensure!(replayed && ran == 2, "a retry must replay, not run again");
    Ok(())
}

keel_examples::runs_to_the_end_test!();
