//! The `orders.placed` consumer: starts the fulfilment saga for each
//! accepted order, through the inbox, exactly once.
//!
//! The runtime records `(event id, group)` in the inbox and runs this
//! handler in the same transaction; the handler records the effect (for
//! the invariant check) and inserts the saga, its first call already
//! claimed. So the saga exists if and only if the event was applied, a
//! redelivered event is a no-op, and the first call waits for the commit.

use async_trait::async_trait;
use keel_messaging::consumer::{DeliveryInfo, Handler, HandlerError};
use keel_messaging::dead_letter::REPLAY_GROUP_HEADER;
use keel_messaging::saga::{SagaDefinition, SagaOrchestrator};
use keel_store::envelope::Envelope;

use super::ShopStore;
use super::model::{DemoFault, OrderPlaced};
use super::saga::FulfilmentData;

/// The consumer group (and inbox scope) of the fulfilment handler.
pub const GROUP: &str = "fulfilment";
/// The topic orders are announced on.
pub const TOPIC: &str = "orders";

/// Starts a fulfilment saga per `shop.order.placed.v1`.
pub struct StartFulfilment<S: ShopStore> {
    store: S,
    orchestrator: SagaOrchestrator<S>,
    saga: SagaDefinition<FulfilmentData>,
}

impl<S: ShopStore> StartFulfilment<S> {
    /// The handler.
    pub fn new(
        store: S,
        orchestrator: SagaOrchestrator<S>,
        saga: SagaDefinition<FulfilmentData>,
    ) -> Self {
        Self {
            store,
            orchestrator,
            saga,
        }
    }
}

/// The demo fault `dead-letter`: every delivery of the original message
/// fails (retryably), so it is dead-lettered; a replay carries the replay
/// header and goes through.
#[derive(Debug, thiserror::Error)]
#[error(
    "demo fault: order {order_id} cannot be handled until it is replayed from the dead-letter store"
)]
pub struct DemoDeadLetter {
    order_id: String,
}

/// How long the demo dead-letter fault asks for between deliveries.
pub const DEMO_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

#[async_trait]
impl<S: ShopStore> Handler<S::Tx> for StartFulfilment<S> {
    async fn handle(
        &self,
        tx: &mut S::Tx,
        envelope: &Envelope,
        info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let placed: OrderPlaced = envelope.data_as()?;
        let replayed = info.message.headers.contains_key(REPLAY_GROUP_HEADER);
        if placed.demo_fault == Some(DemoFault::DeadLetter) && !replayed {
            // As a dependency asking to come back later would: the message
            // stays in the backlog for a few seconds before it is
            // dead-lettered, long enough to watch the lag rise and fall.
            return Err(HandlerError::retry_after(
                DemoDeadLetter {
                    order_id: placed.order_id,
                },
                DEMO_RETRY_AFTER,
            ));
        }
        self.store.record_applied(tx, &info.event_id, GROUP).await?;
        let data = FulfilmentData {
            order_id: placed.order_id.clone(),
            customer_id: placed.customer_id,
            total_cents: placed.total_cents,
            items: placed.items,
            demo_fault: placed.demo_fault,
            extra: placed.extra,
        };
        // The first step's call is claimed in this insert, and the run
        // loop makes it once this transaction has committed: a step costs
        // one save, the first one included.
        let started = self
            .orchestrator
            .start_claimed(tx, &self.saga, &placed.order_id, &data)
            .await
            .map_err(HandlerError::classify)?;
        let orchestrator = self.orchestrator.clone();
        info.on_commit(move || orchestrator.committed(started));
        Ok(())
    }
}
