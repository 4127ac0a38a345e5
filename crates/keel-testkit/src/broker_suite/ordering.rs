//! Per-key order: a message is not delivered while an earlier message of
//! its key is unacked in the group, whatever happens to the earlier one.

use std::sync::Arc;
use std::time::Duration;

use keel_core::clock;
use keel_store::broker::{Broker, Delivery, Message};
use tokio::sync::Mutex;

use super::checker::OrderChecker;
use super::support::{
    LONG_LEASE, PATIENCE, SHORT_LEASE, SLOP, collect, declare_groups, drain_for, ids, message,
    publish, receive, subscribe, unique_topic, wait_for,
};

/// A nacked message, while it waits out its delay, still holds back the
/// later messages of its key (order beats throughput); the key resumes in
/// order once it is acked.
pub async fn per_key_order_under_nack<B: Broker>(broker: B) {
    let topic = unique_topic("order-nack");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(
        &broker,
        &[
            message(&topic, "k-1", "k", "1"),
            message(&topic, "k-2", "k", "2"),
            message(&topic, "k-3", "k", "3"),
            message(&topic, "o-1", "other", "1"),
        ],
    )
    .await;
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let first = collect(sub.as_mut(), 2, PATIENCE).await;
    assert_eq!(
        ids(&first),
        ["k-1", "o-1"],
        "only the first message of each key"
    );
    let extra = receive(sub.as_mut(), 10, Duration::from_millis(200)).await;
    assert!(
        extra.is_empty(),
        "later messages of a busy key: {:?}",
        ids(&extra)
    );

    let k1 = first.iter().find(|d| d.message.id == "k-1").expect("k-1");
    let delay = Duration::from_millis(400);
    let nacked_at = clock::now();
    k1.nack(delay).await.expect("nack");
    for delivery in first.iter().filter(|d| d.message.id == "o-1") {
        delivery.ack().await.expect("ack");
    }
    let (again, others) = wait_for(sub.as_mut(), "k-1", PATIENCE).await;
    assert!(
        others.is_empty(),
        "delivered while k-1 waited out its nack: {:?}",
        ids(&others)
    );
    let (again, at) = again.expect("k-1 comes back");
    assert!(
        at + SLOP >= nacked_at + delay,
        "k-1 came back before its delay"
    );
    assert_eq!(again.delivery_count, 2);
    let extra = receive(sub.as_mut(), 10, Duration::from_millis(200)).await;
    assert!(
        extra.is_empty(),
        "k-2 overtook the redelivered k-1: {:?}",
        ids(&extra)
    );
    again.ack().await.expect("ack");

    let k2 = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&k2), ["k-2"]);
    k2[0].nack(Duration::ZERO).await.expect("nack");
    let k2 = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(
        ids(&k2),
        ["k-2"],
        "a nacked message comes back before the next of its key"
    );
    assert_eq!(k2[0].delivery_count, 2);
    k2[0].ack().await.expect("ack");
    let k3 = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&k3), ["k-3"]);
    k3[0].ack().await.expect("ack");
}

/// A delivery whose lease runs out still holds back its key: the group gets
/// the same message again, never the next one, until it is acked.
pub async fn per_key_order_under_lease_expiry<B: Broker>(broker: B) {
    let topic = unique_topic("order-expiry");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(
        &broker,
        &[
            message(&topic, "k-1", "k", "1"),
            message(&topic, "k-2", "k", "2"),
        ],
    )
    .await;
    let mut crashed = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let mut survivor = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let first = collect(crashed.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["k-1"]);
    // `crashed` never settles; the survivor must get k-1 again, not k-2.
    let (again, others) = wait_for(survivor.as_mut(), "k-1", PATIENCE).await;
    assert!(
        others.is_empty(),
        "k-2 overtook k-1 after its lease ran out: {:?}",
        ids(&others)
    );
    let (again, _) = again.expect("k-1 is redelivered");
    assert_eq!(again.delivery_count, 2);
    again
        .extend_lease(LONG_LEASE)
        .await
        .expect("the survivor keeps working on it");
    let extra = drain_for(survivor.as_mut(), Duration::from_millis(200)).await;
    assert!(extra.is_empty(), "k-2 delivered while k-1 was leased again");
    again.ack().await.expect("ack");
    let k2 = collect(survivor.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&k2), ["k-2"]);
    k2[0].ack().await.expect("ack");
    drop(first);
}

/// A key held back by a long nack delay does not hold back other keys.
pub async fn a_blocked_key_does_not_block_other_keys<B: Broker>(broker: B) {
    let topic = unique_topic("order-isolation");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(
        &broker,
        &[
            message(&topic, "a-1", "a", "1"),
            message(&topic, "b-1", "b", "1"),
            message(&topic, "a-2", "a", "2"),
            message(&topic, "b-2", "b", "2"),
        ],
    )
    .await;
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let first = collect(sub.as_mut(), 2, PATIENCE).await;
    assert_eq!(ids(&first), ["a-1", "b-1"]);
    for delivery in &first {
        if delivery.message.id == "a-1" {
            delivery.nack(Duration::from_secs(20)).await.expect("nack");
        } else {
            delivery.ack().await.expect("ack");
        }
    }
    let next = collect(sub.as_mut(), 1, Duration::from_secs(3)).await;
    assert_eq!(ids(&next), ["b-2"], "key b flows while key a waits");
    next[0].ack().await.expect("ack");
}

/// 1,000 messages over 20 interleaved keys, published while four consumers
/// of one group receive concurrently and nack some deliveries: every message
/// is acked exactly once, no message is held by two consumers at once, and
/// no message is delivered before every earlier message of its key was
/// acked ([`OrderChecker`]).
pub async fn many_keys_interleaved_keep_order<B: Broker>(broker: B) {
    const MESSAGES: usize = 1000;
    const KEYS: u64 = 20;
    const CONSUMERS: usize = 4;
    let topic = unique_topic("order-many");
    let broker = Arc::new(broker);
    let checker = Arc::new(Mutex::new(OrderChecker::new()));

    // A fixed pseudo-random key sequence (reproducible, no RNG needed).
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let messages: Vec<Message> = (0..MESSAGES)
        .map(|i| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let key = format!("entity-{}", (state >> 33) % KEYS);
            message(&topic, &format!("m-{i:04}"), &key, &i.to_string())
        })
        .collect();

    let mut consumers = Vec::new();
    for consumer in 0..CONSUMERS {
        let sub = subscribe(broker.as_ref(), &topic, "g", LONG_LEASE).await;
        consumers.push(tokio::spawn(consume(
            consumer,
            sub,
            checker.clone(),
            MESSAGES,
        )));
    }
    for chunk in messages.chunks(50) {
        {
            let mut checker = checker.lock().await;
            for message in chunk {
                checker.published(message);
            }
        }
        publish(broker.as_ref(), chunk).await;
        tokio::task::yield_now().await;
    }
    for consumer in consumers {
        consumer.await.expect("consumer panicked");
    }
    let checker = checker.lock().await;
    if let Err(problems) = checker.verify() {
        panic!("broker broke the contract:\n{problems}");
    }
    assert!(checker.delivery_count() >= MESSAGES);
}

/// One consumer of the interleaved scenario: nacks roughly one delivery in
/// eight (first deliveries only, so it terminates), acks the rest.
async fn consume(
    consumer: usize,
    mut sub: Box<dyn keel_store::broker::Subscription>,
    checker: Arc<Mutex<OrderChecker>>,
    total: usize,
) {
    let deadline = clock::now() + Duration::from_secs(60);
    let mut decisions: u64 = consumer as u64 + 1;
    while clock::now() < deadline {
        if checker.lock().await.acked_count() >= total {
            return;
        }
        let batch: Vec<Delivery> = receive(sub.as_mut(), 16, Duration::from_millis(100)).await;
        {
            // The whole batch is held from now on.
            let mut checker = checker.lock().await;
            for delivery in &batch {
                checker.delivered(consumer, &delivery.message);
            }
        }
        for delivery in batch {
            decisions = decisions
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let nack = delivery.delivery_count == 1 && (decisions >> 61) == 0;
            checker.lock().await.settling(&delivery.message, !nack);
            let settled = if nack {
                delivery.nack(Duration::from_millis(decisions % 20)).await
            } else {
                delivery.ack().await
            };
            if let Err(error) = settled {
                let what = if nack { "nack" } else { "ack" };
                checker
                    .lock()
                    .await
                    .violation(format!("{what} of {} failed: {error}", delivery.message.id));
            }
        }
    }
    checker
        .lock()
        .await
        .violation(format!("consumer {consumer} gave up after 60 s"));
}
