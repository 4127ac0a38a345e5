//! The tolerant reader: a newer producer adds fields to
//! `shop.order.placed.v1`, at the top and inside an item, and this version
//! of the shop applies the event anyway (no dead letter) and carries the
//! fields it does not know into the saga, unchanged.

mod common;

use std::time::Duration;

use keel::shop::SystemHandle;
use keel::shop::db::ShopDb;
use keel::shop::model::{Item, Order, OrderStatus};
use keel_sqlite::SqliteStore;
use keel_store::Store;
use keel_store::envelope::Envelope;
use keel_store::{DeadLetterFilter, SagaStatus};
use serde_json::json;

async fn start(dir: &std::path::Path) -> SystemHandle<SqliteStore> {
    common::start_embedded(dir).await
}

/// What a v2 producer sends: every v1 field, plus `giftWrap` at the top and
/// `engraving` inside the item.
fn v2_event(order_id: &str) -> Envelope {
    let mut envelope = Envelope::new("/services/orders-v2", "shop.order.placed.v1");
    envelope.subject = Some(order_id.to_owned());
    envelope.data = Some(json!({
        "orderId": order_id,
        "customerId": "c-v2",
        "currency": "EUR",
        "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 450, "engraving": "for Ada"}],
        "totalCents": 450,
        "giftWrap": {"paper": "blue"},
    }));
    envelope
}

fn order(id: &str) -> Order {
    Order {
        id: id.to_owned(),
        customer_id: "c-v2".into(),
        currency: "EUR".into(),
        items: vec![Item::new("tea", 1, 450)],
        total_cents: 450,
        status: OrderStatus::Pending,
        created_at: keel_core::clock::utc_now().to_rfc3339(),
        delivery_estimate: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_order_event_is_applied_and_its_new_fields_are_carried_through() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shop = start(dir.path()).await;
    let order_id = "0190f5c4-6a1e-7b2c-9d3e-4f5a6b7c8d9e";
    let envelope = v2_event(order_id);

    let mut tx = shop.store.begin().await.expect("begin");
    shop.store
        .insert_order(&mut tx, &order(order_id), &envelope.id, None)
        .await
        .expect("insert the order");
    shop.outbox
        .append(&mut tx, "orders", &envelope)
        .await
        .expect("append the v2 event");
    shop.store.commit(tx).await.expect("commit");
    shop.outbox.notify();

    let mut saga = None;
    for _ in 0..300 {
        saga = shop.orchestrator.get(order_id).await.expect("read saga");
        if saga
            .as_ref()
            .is_some_and(|s| s.status == SagaStatus::Completed)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = shop
        .dead_letters
        .list(&DeadLetterFilter::default())
        .await
        .expect("dead letters");
    let saga = saga.expect("the v2 event started a saga");
    shop.shutdown().await;

    assert!(dead.is_empty(), "a v2 event was dead-lettered: {dead:?}");
    assert_eq!(saga.status, SagaStatus::Completed, "{saga:?}");
    assert_eq!(saga.data["giftWrap"], json!({"paper": "blue"}), "{saga:?}");
    assert_eq!(saga.data["items"][0]["engraving"], "for Ada", "{saga:?}");
}
