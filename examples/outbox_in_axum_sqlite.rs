//! The transactional outbox in an axum handler, on the embedded default
//! (SQLite, and Keel's embedded broker on SQLite: no server to run).
//!
//! `POST /orders` writes the order row *and* the event that announces it in
//! one SQLite transaction, so either both exist or neither does: no order
//! without its event, no event for an order that rolled back. A relay then
//! publishes the event to the broker, and an idempotent consumer applies it:
//! its effect (an email row) commits in one transaction with the inbox row
//! that remembers the event, so a redelivered copy is skipped, and the
//! message is acked last.
//!
//! Run: `cargo run -p keel-examples --example outbox_in_axum_sqlite`

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use keel_messaging::consumer::{Consumer, Group, HandlerError};
use keel_messaging::envelope::{Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::Store;
use keel_sqlite::{SqliteBroker, SqliteStore};
use serde::{Deserialize, Serialize};

/// The event, as its consumers read it.
#[derive(Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_minor: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

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
    let store = SqliteStore::open_in_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, total_minor INTEGER NOT NULL);
         CREATE TABLE emails (order_id TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    let broker = Arc::new(SqliteBroker::open_in_memory().await?);
    let outbox = Outbox::new(store.clone()).with_broker(broker.clone());

    // The relay: claims committed events and publishes them, in order per
    // order id. The consumer: the "emails" group, idempotent.
    let relay = OutboxRelay::builder(&outbox, broker.clone()).build()?;
    let emails = Group::new("orders", "emails").on_event(|tx: &mut Tx, order: OrderPlaced, _| {
        Box::pin(async move { send_email(tx, &order).await })
    });
    let consumer = Consumer::builder(store.clone(), broker)
        .group(emails)
        .build()?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let relaying = tokio::spawn({
        let stopped = stopped.clone();
        async move { relay.run(until_stopped(stopped)).await }
    });
    let consuming = tokio::spawn(consumer.run(until_stopped(stopped)));

    let app = Router::new()
        .route("/orders", post(place_order))
        .with_state(outbox);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/orders", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let placed = reqwest::Client::new()
        .post(&url)
        .json(&serde_json::json!({"order_id": "A-4471", "total_minor": 8210}))
        .send()
        .await?;
    println!("POST /orders: {}", placed.status());

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let sent: Vec<String> = sqlx::query_scalar("SELECT order_id FROM emails")
            .fetch_all(store.pool())
            .await?;
        if !sent.is_empty() {
            println!("emails sent for: {sent:?}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no email after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true)?;
    relaying.await?;
    let report = consuming.await?;
    println!("consumer stopped (drained in time: {})", report.drained);
    Ok(())
}
