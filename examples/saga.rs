//! An orchestrated saga: charge, reserve, then the pivot (ship), then a
//! receipt. Before the pivot a step that fails for good makes the saga
//! compensate what it did, in reverse order; after it, the saga only goes
//! forward.
//!
//! Order A-1 has stock: every step runs and the saga completes. Order A-2
//! asks for a sku that is out of stock: the reservation fails permanently,
//! so the payment is refunded and the saga ends `compensated`. Each step
//! carries a derived idempotency key (`saga_id:step`, and
//! `saga_id:undo:step` for its compensation), so a step repeated after a
//! crash is recognised by the service it calls. The saga's state is saved
//! after every step, so an orchestrator killed between any two of them
//! resumes where it stopped.
//!
//! Run: `cargo run -p keel-examples --example saga`

use std::sync::Arc;

use keel_core::Classified;
use keel_messaging::saga::{SagaDefinition, SagaOrchestrator, Step, StepContext};
use keel_sqlite::SqliteStore;
use keel_store::Store;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize)]
struct Order {
    id: String,
    sku: String,
    total_minor: i64,
}

/// What the saga did to the outside world, in order.
type Effects = Arc<Mutex<Vec<String>>>;

/// A step (or compensation) that records `what` under its key.
fn effect(
    effects: &Effects,
    what: &'static str,
) -> impl Fn(StepContext<Order>) -> std::future::Ready<Result<(), Classified>> + Send + Sync + 'static
{
    let effects = effects.clone();
    move |ctx| {
        let line = format!("{what} {} (key {})", ctx.data().id, ctx.idempotency_key());
        effects.lock().push(line);
        std::future::ready(Ok(()))
    }
}

fn fulfilment(effects: &Effects) -> anyhow::Result<SagaDefinition<Order>> {
    let reserve = {
        let effects = effects.clone();
        move |ctx: StepContext<Order>| {
            let order = ctx.data();
            let result = if order.sku == "sold-out" {
                Err(Classified::permanent(format!(
                    "{} is out of stock",
                    order.sku
                )))
            } else {
                let key = ctx.idempotency_key();
                effects
                    .lock()
                    .push(format!("reserve {} (key {key})", order.id));
                Ok(())
            };
            std::future::ready(result)
        }
    };
    let saga = SagaDefinition::<Order>::builder("order_fulfilment")
        .step(
            Step::new("charge", effect(effects, "charge"))
                .compensate_with(effect(effects, "refund")),
        )
        .step(Step::new("reserve", reserve).compensate_with(effect(effects, "release")))
        .pivot(Step::new("ship", effect(effects, "ship")))
        .step(Step::new("receipt", effect(effects, "receipt")))
        .build()?;
    Ok(saga)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    let store = SqliteStore::open_in_memory().await?;
    let effects = Effects::default();
    let saga = fulfilment(&effects)?;
    let orchestrator = SagaOrchestrator::builder(store.clone())
        .saga(&saga)
        .build()?;

    for (id, sku) in [("A-1", "tea"), ("A-2", "sold-out")] {
        // A saga starts in the caller's transaction (with the order row, or
        // in the inbox handler of the event that placed it).
        let mut tx = store.begin().await?;
        let order = Order {
            id: id.into(),
            sku: sku.into(),
            total_minor: 8210,
        };
        orchestrator.start(&mut tx, &saga, id, &order).await?;
        store.commit(tx).await?;
        // `run` drives every due saga in the background; `drive` runs one
        // until it is finished or waiting, which suits an example.
        let record = orchestrator.drive(id).await?;
        println!(
            "{id}: {:?} {}",
            record.status,
            record.last_error.unwrap_or_default()
        );
    }
    for line in effects.lock().iter() {
        println!("  {line}");
    }
    Ok(())
}

keel_examples::runs_to_the_end_test!();
