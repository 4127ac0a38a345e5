//! `POST /orders` when the connection is lost during COMMIT: the outcome is
//! unknown, so the server answers `503` and releases the Idempotency-Key,
//! and the client's retry resolves it by reading back: it finds the order
//! if the commit landed, places it if not. Either way there is exactly one
//! order, never none after a `2xx` and never two.
//!
//! The loss is the failpoint `keel-orders-commit-lost`; the shop runs in
//! this process on SQLite and the embedded broker (feature `chaos`).

#![cfg(feature = "chaos")]

mod common;

use std::time::Duration;

use keel::shop::SystemHandle;
use keel_sqlite::SqliteStore;
use reqwest::StatusCode;
use serde_json::{Value, json};

async fn start(dir: &std::path::Path) -> SystemHandle<SqliteStore> {
    common::start_embedded(dir).await
}

async fn place(http: &reqwest::Client, base_url: &str, key: &str) -> (StatusCode, Value) {
    let order = json!({
        "customerId": "c-lost-commit",
        "currency": "EUR",
        "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 450}]
    });
    let response = http
        .post(format!("{base_url}/orders"))
        .header("idempotency-key", key)
        .json(&order)
        .send()
        .await
        .expect("POST /orders");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn orders_of_customer(http: &reqwest::Client, base_url: &str) -> Vec<Value> {
    let page: Value = http
        .get(format!(
            "{base_url}/orders?limit=100&customerId=c-lost-commit"
        ))
        .send()
        .await
        .expect("GET /orders")
        .json()
        .await
        .expect("a page");
    page["items"].as_array().expect("items").clone()
}

/// Arms the failpoint for one commit, places an order that hits it, then
/// retries until accepted; returns the first answer and the accepted order.
async fn lose_one_commit(action: &str, key: &str) -> (StatusCode, Value, Vec<Value>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let shop = start(dir.path()).await;
    let http = reqwest::Client::new();
    fail::cfg("keel-orders-commit-lost", action).expect("arm the failpoint");
    let (first, problem) = place(&http, &shop.base_url, key).await;
    fail::remove("keel-orders-commit-lost");
    let mut accepted = Value::Null;
    for _ in 0..50 {
        let (status, body) = place(&http, &shop.base_url, key).await;
        if status == StatusCode::CREATED {
            accepted = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!accepted.is_null(), "the retry was never accepted");
    let orders = orders_of_customer(&http, &shop.base_url).await;
    assert_eq!(orders.len(), 1, "exactly one order: {orders:#?}");
    assert_eq!(orders[0]["id"], accepted["id"]);
    shop.shutdown().await;
    (first, problem, orders)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_landed_is_found_by_the_retry() {
    let (first, problem, _) = lose_one_commit("1*return(committed)", "lost-after").await;
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert_eq!(problem["status"], 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_did_not_land_is_placed_by_the_retry() {
    let (first, problem, _) = lose_one_commit("1*return", "lost-before").await;
    assert_eq!(first, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
}
