//! Helpers the suite's scenarios share: unique names, receiving until
//! something arrives, and the timing constants.

use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_store::broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};

/// A lease short enough to watch expire in a test.
pub(crate) const SHORT_LEASE: Duration = Duration::from_millis(300);
/// A lease that never expires within a test.
pub(crate) const LONG_LEASE: Duration = Duration::from_secs(30);
/// How long to wait for something that must arrive.
pub(crate) const PATIENCE: Duration = Duration::from_secs(5);
/// Tolerance for clocks that count in whole milliseconds.
pub(crate) const SLOP: Duration = Duration::from_millis(25);

/// A topic name no other test (or earlier run against a shared broker) uses.
pub(crate) fn unique_topic(scenario: &str) -> String {
    format!(
        "keel-conformance.{scenario}.{}",
        keel_core::id::new_id().simple()
    )
}

/// A message with the given id, key and payload.
pub(crate) fn message(topic: &str, id: &str, key: &str, payload: &str) -> Message {
    Message::new(id, topic, key, payload.to_owned())
}

/// Publishes, failing the test on error.
pub(crate) async fn publish<B: Broker + ?Sized>(broker: &B, messages: &[Message]) {
    broker.publish(messages).await.expect("publish failed");
}

/// Subscribes `group` to `topic` with `lease`, failing the test on error.
pub(crate) async fn subscribe<B: Broker + ?Sized>(
    broker: &B,
    topic: &str,
    group: &str,
    lease: Duration,
) -> Box<dyn Subscription> {
    broker
        .subscribe(SubscribeOptions::new(topic, group).lease(lease))
        .await
        .expect("subscribe failed")
}

/// Declares `groups` on `topic` before a scenario publishes to it
/// ([`Broker::declare_group`]): where groups start at their creation, the
/// scenarios' point is what a group does with messages published while it
/// exists. Elsewhere declaring does nothing.
pub(crate) async fn declare_groups<B: Broker + ?Sized>(broker: &B, topic: &str, groups: &[&str]) {
    for group in groups {
        broker
            .declare_group(&SubscribeOptions::new(topic, *group).lease(LONG_LEASE))
            .await
            .expect("declare_group failed");
    }
}

/// One receive, failing the test on error.
pub(crate) async fn receive(
    sub: &mut dyn Subscription,
    max: usize,
    wait: Duration,
) -> Vec<Delivery> {
    sub.receive(max, wait).await.expect("receive failed")
}

/// Receives until `n` deliveries arrived or `within` passed.
pub(crate) async fn collect(
    sub: &mut dyn Subscription,
    n: usize,
    within: Duration,
) -> Vec<Delivery> {
    let deadline = clock::now() + within;
    let mut got = Vec::new();
    while got.len() < n {
        let now = clock::now();
        if now >= deadline {
            break;
        }
        let wait = (deadline - now).min(Duration::from_millis(500));
        got.extend(receive(sub, n - got.len(), wait).await);
    }
    got
}

/// Everything delivered during `period`, each with the time its receive
/// returned (so a scenario can tell "too early" from "after a stall").
pub(crate) async fn drain_for(
    sub: &mut dyn Subscription,
    period: Duration,
) -> Vec<(Delivery, Instant)> {
    let deadline = clock::now() + period;
    let mut got = Vec::new();
    loop {
        let now = clock::now();
        if now >= deadline {
            return got;
        }
        let batch = receive(sub, 16, deadline - now).await;
        let at = clock::now();
        got.extend(batch.into_iter().map(|d| (d, at)));
    }
}

/// The first delivery of message `id` within `within`, with the time its
/// receive returned; every other delivery seen on the way is returned too.
pub(crate) async fn wait_for(
    sub: &mut dyn Subscription,
    id: &str,
    within: Duration,
) -> (Option<(Delivery, Instant)>, Vec<Delivery>) {
    let deadline = clock::now() + within;
    let mut others = Vec::new();
    loop {
        let now = clock::now();
        if now >= deadline {
            return (None, others);
        }
        let batch = receive(sub, 16, (deadline - now).min(Duration::from_millis(500))).await;
        let at = clock::now();
        let mut found = None;
        for delivery in batch {
            if found.is_none() && delivery.message.id == id {
                found = Some((delivery, at));
            } else {
                others.push(delivery);
            }
        }
        if found.is_some() {
            return (found, others);
        }
    }
}

/// The ids of some deliveries, sorted.
pub(crate) fn ids<'a>(deliveries: impl IntoIterator<Item = &'a Delivery>) -> Vec<String> {
    let mut ids: Vec<String> = deliveries
        .into_iter()
        .map(|d| d.message.id.clone())
        .collect();
    ids.sort();
    ids
}

/// Acks every delivery, failing the test on error.
pub(crate) async fn ack_all(deliveries: &[Delivery]) {
    for delivery in deliveries {
        delivery.ack().await.expect("ack failed");
    }
}
