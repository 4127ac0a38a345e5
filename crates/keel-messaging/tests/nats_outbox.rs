//! The outbox in front of JetStream (issue 11): what NATS can never take —
//! a key with a line break (it travels as a header), a message over the
//! server's `max_payload` — is refused by `Outbox::append` when the outbox
//! knows the broker, and parked by the relay when it does not, while every
//! other row is published.

#[path = "../../keel-nats/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fresh_broker;
use keel_core::clock;
use keel_messaging::broker::{Broker, BrokerError, SubscribeOptions};
use keel_messaging::envelope::Envelope;
use keel_messaging::outbox::{Outbox, OutboxError, OutboxRelay};
use keel_messaging::store::{OutboxAdminStore, OutboxStore, ParkedFilter, Store};
use keel_sqlite::SqliteStore;

const TOPIC: &str = "orders";

fn event(key: &str) -> Envelope {
    let mut env = Envelope::new("/services/orders", "shop.order.placed.v1");
    env.subject = Some(key.to_owned());
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_refuses_a_key_with_a_line_break_and_an_oversized_event() {
    let Some(test) = fresh_broker().await else {
        return;
    };
    let broker = Arc::new(test.broker.clone());
    let store = SqliteStore::open_in_memory().await.expect("store");
    let outbox = Outbox::new(store.clone())
        .with_max_size(64 * 1024 * 1024)
        .with_broker(Arc::clone(&broker));
    let mut tx = store.begin().await.expect("begin");

    let err = outbox
        .append(&mut tx, TOPIC, &event("order\n7"))
        .await
        .expect_err("a line break in the key");
    assert!(
        matches!(
            &err,
            OutboxError::Unpublishable { key, reason: BrokerError::Invalid(why), .. }
                if key == "order\n7" && why.contains("line break")
        ),
        "{err:?}"
    );

    let max = broker.client().max_payload();
    let mut big = event("order-8");
    big.data = Some(serde_json::Value::String("x".repeat(max + 1)));
    let err = outbox
        .append(&mut tx, TOPIC, &big)
        .await
        .expect_err("over max_payload");
    assert!(
        matches!(&err, OutboxError::Unpublishable { reason: BrokerError::Invalid(why), .. }
            if why.contains("max_payload")),
        "{err:?}"
    );

    outbox
        .append(&mut tx, TOPIC, &event("order-9"))
        .await
        .expect("a good event in the same transaction");
    outbox.commit(tx).await.expect("commit");
    assert_eq!(
        store.outbox_stats().await.expect("stats").unpublished,
        1,
        "only the good event was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_parks_a_key_with_a_line_break_and_publishes_the_rest() {
    let Some(test) = fresh_broker().await else {
        return;
    };
    let broker = Arc::new(test.broker.clone());
    let store = SqliteStore::open_in_memory().await.expect("store");
    // No broker rules at append: the bad rows reach the outbox, as they
    // would from a process configured without them.
    let outbox = Outbox::new(store.clone());
    let envs: Vec<Envelope> = ["order-1", "order\n2", "order-3", "order\n2", "order-4"]
        .into_iter()
        .map(event)
        .collect();
    let mut tx = store.begin().await.expect("begin");
    outbox
        .append_all(&mut tx, TOPIC, &envs)
        .await
        .expect("append");
    outbox.commit(tx).await.expect("commit");

    let relay = OutboxRelay::builder(&outbox, Arc::clone(&broker))
        .build()
        .expect("relay");
    assert_eq!(relay.run_once().await.expect("round"), 3);
    assert_eq!(relay.run_once().await.expect("round"), 0, "no retry loop");
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!((stats.parked, stats.unpublished), (1, 1));
    let parked = store
        .outbox_parked(&ParkedFilter::default())
        .await
        .expect("parked");
    assert_eq!(parked[0].record.event_id, envs[1].id);
    assert!(parked[0].last_error.contains("line break"), "{parked:?}");

    let mut sub = broker
        .subscribe(SubscribeOptions::new(TOPIC, "audit"))
        .await
        .expect("subscribe");
    let deadline = clock::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < 3 && clock::now() < deadline {
        for d in sub
            .receive(10, Duration::from_millis(500))
            .await
            .expect("receive")
        {
            d.ack().await.expect("ack");
            got.push(d.message.id);
        }
    }
    got.sort();
    let mut expected = vec![envs[0].id.clone(), envs[2].id.clone(), envs[4].id.clone()];
    expected.sort();
    assert_eq!(got, expected, "every other row reached JetStream");
}
