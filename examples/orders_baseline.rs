//! The yardstick for `keel serve`'s `POST /orders`: what a new user writes
//! by hand with axum and sqlx, and nothing more. The order row and its
//! outbox row commit in one transaction on SQLite (WAL, `synchronous =
//! FULL`, one writer connection); there is no idempotency, no relay, no
//! consumer, no policy. `scripts/load/orders-compare.sh` runs it beside
//! `keel serve` under the same `wrk` load (BENCHMARKS.md).
//!
//! Run: `cargo run --release -p keel-examples --example orders_baseline --
//! 127.0.0.1:18081 /tmp/baseline.db`

use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use sqlx::sqlite::SqliteSynchronous;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewOrder {
    customer_id: String,
    currency: String,
    items: Vec<Item>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Item {
    qty: i64,
    unit_price_cents: i64,
}

struct App {
    pool: SqlitePool,
    next: AtomicU64,
}

async fn place(
    State(app): State<std::sync::Arc<App>>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
    let total: i64 = order.items.iter().map(|i| i.qty * i.unit_price_cents).sum();
    let id = format!("ord-{}", app.next.fetch_add(1, Ordering::Relaxed));
    let event =
        serde_json::json!({ "orderId": id, "customerId": order.customer_id, "totalCents": total });
    let fail = |_| StatusCode::SERVICE_UNAVAILABLE;
    let mut tx = app.pool.begin().await.map_err(fail)?;
    sqlx::query("INSERT INTO orders (id, customer_id, currency, total_cents) VALUES (?, ?, ?, ?)")
        .bind(&id)
        .bind(&order.customer_id)
        .bind(&order.currency)
        .bind(total)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    sqlx::query("INSERT INTO outbox (topic, partition_key, payload) VALUES ('orders', ?, ?)")
        .bind(&id)
        .bind(event.to_string())
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "id": id, "totalCents": total })),
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:18081".into());
    let path = args
        .next()
        .unwrap_or_else(|| "/tmp/orders-baseline.db".into());
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer_id TEXT NOT NULL, \
         currency TEXT NOT NULL, total_cents INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY, topic TEXT NOT NULL, \
         partition_key TEXT NOT NULL, payload TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let app = std::sync::Arc::new(App {
        pool,
        next: AtomicU64::new(0),
    });
    let router = Router::new().route("/orders", post(place)).with_state(app);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    axum::serve(listener, router).await?;
    Ok(())
}
