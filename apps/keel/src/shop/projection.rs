//! Fan-out: when an order's saga reaches a new state, the order row moves
//! to it, the customer's event log gets an event (long poll, SSE and
//! WebSocket read it) and subscribed webhook endpoints get a delivery, all
//! in one transaction.
//!
//! It polls the saga table rather than hooking into the orchestrator, so it
//! also catches sagas finished by another process or by an operator.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_realtime::{EventLog, StreamId};
use keel_webhooks::{DeliveryWorker, WebhookEvent, WebhookOutbox};
use tokio::sync::watch;

use super::ShopStore;
use super::db::Settled;

/// How many orders one round settles at most.
const BATCH: usize = 200;

/// The event-log stream of a customer.
pub fn customer_stream(customer_id: &str) -> Option<StreamId> {
    StreamId::new(format!("customer:{customer_id}")).ok()
}

/// The event type announcing a settled order, e.g. `order.completed`.
pub fn event_type(settled: &Settled) -> String {
    format!("order.{}", settled.status.as_str())
}

/// Settles orders whose sagas moved on.
pub struct Projection<S: ShopStore> {
    store: S,
    log: EventLog<S>,
    webhooks: WebhookOutbox<S>,
    worker: DeliveryWorker<S>,
    settled: Arc<AtomicU64>,
}

impl<S: ShopStore> Projection<S> {
    /// A projection writing through `log` and `webhooks`; it wakes
    /// `worker` when it queued deliveries.
    pub fn new(
        store: S,
        log: EventLog<S>,
        webhooks: WebhookOutbox<S>,
        worker: DeliveryWorker<S>,
    ) -> Self {
        Self {
            store,
            log,
            webhooks,
            worker,
            settled: Arc::default(),
        }
    }

    /// How many order state changes it has applied.
    pub fn counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.settled)
    }

    /// One round; returns how many orders moved.
    pub async fn run_once(&self) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
        let mut tx = self.store.begin().await?;
        let settled = self.store.settle_orders(&mut tx, BATCH).await?;
        if settled.is_empty() {
            self.store.rollback(tx).await?;
            return Ok(0);
        }
        let mut appended = Vec::with_capacity(settled.len());
        let mut events = Vec::with_capacity(settled.len());
        for s in &settled {
            let ty = event_type(s);
            let data = serde_json::json!({"orderId": s.order_id, "status": s.status});
            if let Some(stream) = customer_stream(&s.customer_id) {
                appended.push(self.log.append(&mut tx, &stream, &ty, &data).await?);
            }
            events.push(
                WebhookEvent::new(ty, data)
                    .with_source(crate::api::orders::SOURCE)
                    .with_id(format!("{}:{}", s.order_id, s.status.as_str())),
            );
        }
        let queued = self.webhooks.enqueue(&mut tx, &events).await?;
        self.log.commit(tx, appended).await?;
        if queued > 0 {
            self.worker.notify();
        }
        self.settled
            .fetch_add(settled.len() as u64, Ordering::Relaxed);
        Ok(settled.len())
    }

    /// Runs rounds every `interval` (at once again after a full batch)
    /// until `shutdown` turns `true`.
    pub async fn run(&self, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        loop {
            let moved = match self.run_once().await {
                Ok(n) => n,
                Err(err) => {
                    tracing::warn!(error = %err, "settling orders failed; will retry");
                    0
                }
            };
            if moved >= BATCH {
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
        }
    }
}
