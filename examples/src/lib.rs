//! Keel's first-contact programs. Each is one file in `examples/`, runs on
//! its own and shows one thing:
//!
//! - `dependency_with_policies`: a call to another service behind a
//!   timeout, a retry and a circuit breaker, with the deadline and trace
//!   context sent along;
//! - `outbox_in_axum_sqlite`: an axum handler that writes an order and the
//!   event announcing it in one SQLite transaction, a relay that publishes
//!   the event, and an idempotent consumer that applies it;
//! - `outbox_in_axum_postgres`: the same on PostgreSQL (`DATABASE_URL`);
//!   only the SQL and the store change;
//! - `saga`: an orchestrated saga with a pivot, whose failure after the
//!   pivot goes forward and before it compensates;
//! - `idempotency_keys`: an axum route behind the `Idempotency-Key` layer:
//!   a retry replays the first answer, a different body is a `422`;
//! - `sse_with_resume`: an event log served over SSE, read, dropped and
//!   resumed with `Last-Event-ID`, with nothing lost or repeated;
//! - `webhooks`: signed webhooks queued in a transaction, delivered by a
//!   worker, verified and deduplicated by a receiver.
//!
//! Run one with `cargo run -p keel-examples --example NAME`. The test suite
//! builds every example, so they cannot rot.
//!
//! This library holds what the outbox examples share, because none of it
//! depends on the database: the relay, the consumer and the HTTP round trip.

/// The test each self-contained example carries, so the suite runs it to
/// the end: `keel_examples::runs_to_the_end_test!();` after its `run`.
#[macro_export]
macro_rules! runs_to_the_end_test {
    () => {
        #[cfg(test)]
        mod tests {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn runs_to_the_end() {
                super::run().await.expect("the example runs");
            }
        }
    };
}

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use keel_messaging::consumer::{Consumer, ConsumerStore, Group};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_sqlite::SqliteBroker;
use keel_store::OutboxStore;
use keel_store::envelope::Event;
use serde::{Deserialize, Serialize};

/// The event the outbox examples announce an order with.
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order.
    pub order_id: String,
    /// Its total in minor units (cents).
    pub total_minor: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

/// Serves `app` on loopback with a relay and a consumer running, posts one
/// order to it, and waits until `emails_sent` reports its email.
///
/// The relay publishes what the handler committed; the consumer runs
/// `emails` (whose effect commits with its inbox row) and acks last.
pub async fn place_one_order<S, F, Fut>(
    outbox: &Outbox<S>,
    broker: Arc<SqliteBroker>,
    emails: Group<S::Tx>,
    app: Router,
    emails_sent: F,
) -> anyhow::Result<()>
where
    S: OutboxStore + ConsumerStore,
    S::Tx: 'static,
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<String>>>,
{
    let relay = OutboxRelay::builder(outbox, broker.clone()).build()?;
    let consumer = Consumer::builder(outbox.store().clone(), broker)
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
        let sent = emails_sent().await?;
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
