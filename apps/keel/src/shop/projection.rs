//! Fan-out: when an order's saga reaches a new state, the order row moves
//! to it, the customer's event log gets an event (long poll, SSE and
//! WebSocket read it) and subscribed webhook endpoints get a delivery.
//!
//! It is a [`SagaHook`]: all of it is written in the transaction that saves
//! the saga's new status, so an order can never show a state its saga
//! does not have, whichever process (or operator) moved the saga, and the
//! shop never reads the library's saga table.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use keel_messaging::saga::{AfterCommit, SagaHook};
use keel_realtime::{AppendError, EventLog, StreamId};
use keel_store::StoreError;
use keel_store::{SagaRecord, SagaStatus};
use keel_webhooks::{DeliveryWorker, WebhookError, WebhookEvent, WebhookOutbox};

use super::ShopStore;
use super::db::Settled;
use super::model::OrderStatus;

/// The event-log stream of a customer.
pub fn customer_stream(customer_id: &str) -> Option<StreamId> {
    StreamId::new(format!("customer:{customer_id}")).ok()
}

/// The event type announcing a settled order, e.g. `order.completed`.
pub fn event_type(settled: &Settled) -> String {
    format!("order.{}", settled.status.as_str())
}

/// The order status a saga status settles an order in; `None` while the
/// saga is still on its way.
fn settles_as(status: SagaStatus) -> Option<OrderStatus> {
    match status {
        SagaStatus::Completed => Some(OrderStatus::Completed),
        SagaStatus::Compensated => Some(OrderStatus::Compensated),
        SagaStatus::Stuck => Some(OrderStatus::Stuck),
        SagaStatus::Cancelled => Some(OrderStatus::Cancelled),
        SagaStatus::Running | SagaStatus::Compensating => None,
    }
}

/// Records the order's "critical time", from intake to settled, in
/// `keel_order_critical_seconds` (by the status it settled in): the
/// figure a customer waits for, and the console graphs. Only a terminal
/// status counts: a stuck order has not settled yet.
fn record_critical_time(placed_at: &str, status: OrderStatus) {
    if status == OrderStatus::Stuck {
        return;
    }
    let Ok(placed) = chrono::DateTime::parse_from_rfc3339(placed_at) else {
        return;
    };
    let waited = keel_core::clock::utc_now().signed_duration_since(placed);
    let seconds = waited.num_milliseconds().max(0) as f64 / 1000.0;
    metrics::histogram!("keel_order_critical_seconds", "status" => status.as_str()).record(seconds);
}

/// Settles an order when its fulfilment saga moves on.
pub struct OrderSettlement<S: ShopStore> {
    store: S,
    log: EventLog<S>,
    webhooks: WebhookOutbox<S>,
    worker: DeliveryWorker<S>,
    settled: Arc<AtomicU64>,
}

impl<S: ShopStore> OrderSettlement<S> {
    /// A settlement writing through `log` and `webhooks`; it wakes `worker`
    /// when it queued deliveries.
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

    /// How many order state changes it has committed.
    pub fn counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.settled)
    }

    async fn announce(&self, tx: &mut S::Tx, settled: &Settled) -> Result<AfterCommit, StoreError> {
        let ty = event_type(settled);
        let data = serde_json::json!({"orderId": settled.order_id, "status": settled.status});
        let appended = match customer_stream(&settled.customer_id) {
            Some(stream) => Some(self.log.append(tx, &stream, &ty, &data).await.map_err(
                |err| match err {
                    AppendError::Store(err) => err,
                    other => StoreError::other(other),
                },
            )?),
            None => None,
        };
        let event = WebhookEvent::new(ty, data)
            .with_source(crate::api::orders::SOURCE)
            .with_id(format!("{}:{}", settled.order_id, settled.status.as_str()));
        let queued = match self.webhooks.enqueue(tx, &[event]).await {
            Ok(queued) => queued > 0,
            Err(WebhookError::Store(err)) => return Err(err),
            Err(other) => return Err(StoreError::other(other)),
        };
        let (log, worker, counter) = (
            self.log.clone(),
            self.worker.clone(),
            Arc::clone(&self.settled),
        );
        let (placed_at, status) = (settled.placed_at.clone(), settled.status);
        Ok(AfterCommit::then(move || {
            record_critical_time(&placed_at, status);
            if let Some(appended) = appended {
                log.notify(&appended);
            }
            if queued {
                worker.notify();
            }
            counter.fetch_add(1, Ordering::Relaxed);
        }))
    }
}

#[async_trait]
impl<S: ShopStore> SagaHook<S> for OrderSettlement<S> {
    async fn status_changed(
        &self,
        tx: &mut S::Tx,
        _prev: &SagaRecord,
        next: &SagaRecord,
    ) -> Result<AfterCommit, StoreError> {
        let Some(status) = settles_as(next.status).filter(|_| next.kind == super::saga::SAGA)
        else {
            return Ok(AfterCommit::nothing());
        };
        match self.store.settle_order(tx, &next.id, status).await? {
            Some(settled) => self.announce(tx, &settled).await,
            None => Ok(AfterCommit::nothing()),
        }
    }
}
