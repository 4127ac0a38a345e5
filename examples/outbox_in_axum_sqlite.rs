//! The transactional outbox in an axum handler, on the embedded default
//! (SQLite, and Keel's embedded broker on SQLite: no server to run).
//!
//! `POST /orders` writes the order row *and* the event that announces it in
//! one SQLite transaction, so either both exist or neither does: no order
//! without its event, no event for an order that rolled back. A relay then
//! publishes the event to the broker, and an idempotent consumer applies it:
//! its effect (an email row) commits in one transaction with the inbox row
//! that remembers the event, so a redelivered copy is skipped, and the
//! message is acked last. The relay, the consumer and the HTTP round trip
//! are the same on every database, so they live in this package's library
//! (`keel_examples::place_one_order`); this file is what is SQLite's.
//!
//! Run: `cargo run -p keel-examples --example outbox_in_axum_sqlite`

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use keel_examples::OrderPlaced;
use keel_messaging::consumer::{Group, HandlerError};
use keel_messaging::outbox::Outbox;
use keel_sqlite::{SqliteBroker, SqliteStore};
use keel_store::Store;
use keel_store::envelope::EventMeta;

type Tx = <SqliteStore as Store>::Tx;

/// The consumer's effect, written in its transaction (with the inbox row).
async fn send_email(tx: &mut Tx, order: &OrderPlaced) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO emails (order_id) VALUES ($1)")
        .bind(&order.order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The order and its event, in one transaction.
async fn place_order(
    State(outbox): State<Outbox<SqliteStore>>,
    Json(order): Json<OrderPlaced>,
) -> Result<StatusCode, (StatusCode, String)> {
    let failed = |e: &dyn std::fmt::Display| (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    let mut tx = outbox.store().begin().await.map_err(|e| failed(&e))?;
    sqlx::query("INSERT INTO orders (id, total_minor) VALUES ($1, $2)")
        .bind(&order.order_id)
        .bind(order.total_minor)
        .execute(&mut *tx)
        .await
        .map_err(|e| failed(&e))?;
    outbox
        .append_event(
            &mut tx,
            "orders",
            "/services/orders",
            &order,
            EventMeta::new(1),
        )
        .await
        .map_err(|e| failed(&e))?;
    // Commits, then wakes the relay so the event leaves at once.
    outbox.commit(tx).await.map_err(|e| failed(&e))?;
    Ok(StatusCode::CREATED)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    let store = SqliteStore::open_in_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, total_minor INTEGER NOT NULL);
         CREATE TABLE emails (order_id TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    let broker = Arc::new(SqliteBroker::open_in_memory().await?);
    let outbox = Outbox::new(store.clone()).with_broker(broker.clone());

    // The "emails" consumer group, idempotent: its effect commits with the
    // inbox row that remembers the event.
    let emails = Group::new("orders", "emails").on_event(|tx: &mut Tx, order: OrderPlaced, _| {
        Box::pin(async move { send_email(tx, &order).await })
    });
    let app = Router::new()
        .route("/orders", post(place_order))
        .with_state(outbox.clone());
    let emails_sent = || async {
        let sent: Vec<String> = sqlx::query_scalar("SELECT order_id FROM emails")
            .fetch_all(store.pool())
            .await?;
        Ok(sent)
    };
    keel_examples::place_one_order(&outbox, broker, emails, app, emails_sent).await
}

keel_examples::runs_to_the_end_test!();
