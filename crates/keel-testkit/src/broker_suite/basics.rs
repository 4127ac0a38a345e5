//! Publishing, groups, acks and waiting: the everyday contract.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use keel_core::clock;
use keel_store::broker::{Backlog, Broker, Delivery, GroupStart, Message};

use super::support::{
    LONG_LEASE, PATIENCE, SHORT_LEASE, ack_all, collect, declare_groups, ids, message, publish,
    receive, subscribe, unique_topic,
};

/// What was published arrives intact: id, topic, key, headers (a broker may
/// add its own) and payload, text, binary or empty; first delivery count 1.
pub async fn publish_then_receive<B: Broker>(broker: B) {
    let topic = unique_topic("publish-receive");
    declare_groups(&broker, &topic, &["reader"]).await;
    let sent = vec![
        message(&topic, "m-1", "k-1", "one").with_header("x-tenant", "acme"),
        Message::new("m-2", &topic, "k-2", Bytes::from_static(&[0, 159, 255, 10])),
        Message::new("m-3", &topic, "k-3", Bytes::new()),
    ];
    publish(&broker, &sent).await;
    let mut sub = subscribe(&broker, &topic, "reader", LONG_LEASE).await;
    let got = collect(sub.as_mut(), 3, PATIENCE).await;
    assert_eq!(
        ids(&got),
        ["m-1", "m-2", "m-3"],
        "every published message arrives once"
    );
    for delivery in &got {
        let original = sent
            .iter()
            .find(|m| m.id == delivery.message.id)
            .expect("a message that was published");
        let received = &delivery.message;
        assert_eq!(received.topic, original.topic);
        assert_eq!(received.key, original.key);
        assert_eq!(
            received.payload, original.payload,
            "payload of {}",
            original.id
        );
        for (name, value) in &original.headers {
            assert_eq!(
                received.header(name),
                Some(value.as_str()),
                "header {name} of {}",
                original.id
            );
        }
        assert_eq!(
            delivery.delivery_count, 1,
            "first delivery of {}",
            original.id
        );
    }
    ack_all(&got).await;
}

/// Two groups on one topic each receive every message.
pub async fn every_group_gets_every_message<B: Broker>(broker: B) {
    let topic = unique_topic("groups");
    let mut billing = subscribe(&broker, &topic, "billing", LONG_LEASE).await;
    let mut shipping = subscribe(&broker, &topic, "shipping", LONG_LEASE).await;
    let sent: Vec<Message> = (0..10)
        .map(|i| message(&topic, &format!("m-{i:02}"), &format!("k-{i}"), "x"))
        .collect();
    publish(&broker, &sent).await;
    let expected = ids_of(&sent);
    for (name, sub) in [("billing", &mut billing), ("shipping", &mut shipping)] {
        let got = collect(sub.as_mut(), sent.len(), PATIENCE).await;
        assert_eq!(ids(&got), expected, "group {name} receives every message");
        ack_all(&got).await;
    }
}

/// Consumers of one group share the work: together they receive every
/// message, and no message is held by two of them at once.
pub async fn group_members_split_the_work<B: Broker>(broker: B) {
    let topic = unique_topic("split");
    declare_groups(&broker, &topic, &["workers"]).await;
    let broker = Arc::new(broker);
    let sent: Vec<Message> = (0..20)
        .map(|i| message(&topic, &format!("m-{i:02}"), &format!("k-{i}"), "x"))
        .collect();
    publish(broker.as_ref(), &sent).await;
    let taken = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..2 {
        let mut sub = subscribe(broker.as_ref(), &topic, "workers", LONG_LEASE).await;
        let taken = taken.clone();
        workers.push(tokio::spawn(async move {
            let deadline = clock::now() + PATIENCE;
            let mut held: Vec<Delivery> = Vec::new();
            // Hold everything (no acks) until the group has all 20 out.
            while taken.load(Ordering::SeqCst) < 20 && clock::now() < deadline {
                let batch = receive(sub.as_mut(), 5, Duration::from_millis(100)).await;
                taken.fetch_add(batch.len(), Ordering::SeqCst);
                held.extend(batch);
            }
            (sub, held)
        }));
    }
    let mut holdings = Vec::new();
    for worker in workers {
        holdings.push(worker.await.expect("worker panicked"));
    }
    let (first, second) = (ids(&holdings[0].1), ids(&holdings[1].1));
    let overlap: Vec<&String> = first.iter().filter(|id| second.contains(id)).collect();
    assert!(
        overlap.is_empty(),
        "held by both consumers at once: {overlap:?}"
    );
    let union: BTreeSet<String> = first.iter().chain(&second).cloned().collect();
    assert_eq!(
        union.into_iter().collect::<Vec<_>>(),
        ids_of(&sent),
        "together they get everything"
    );
    // Everything is leased: nobody in the group gets anything more.
    for (sub, _) in &mut holdings {
        let extra = receive(sub.as_mut(), 10, Duration::from_millis(200)).await;
        assert!(
            extra.is_empty(),
            "leased messages were delivered again: {:?}",
            ids(&extra)
        );
    }
    for (_, held) in &holdings {
        ack_all(held).await;
    }
}

/// An acked message is never delivered to the group again, even after its
/// lease would have run out.
pub async fn ack_means_never_again<B: Broker>(broker: B) {
    let topic = unique_topic("ack");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(&broker, &[message(&topic, "m-1", "k", "x")]).await;
    let mut sub = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let got = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&got), ["m-1"]);
    got[0].ack().await.expect("ack");
    let again = receive(sub.as_mut(), 10, SHORT_LEASE * 3).await;
    assert!(
        again.is_empty(),
        "acked message came back: {:?}",
        ids(&again)
    );
}

/// A terminated message is never delivered again, and the next message of
/// its key is released.
pub async fn terminate_means_never_again<B: Broker>(broker: B) {
    let topic = unique_topic("terminate");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(
        &broker,
        &[
            message(&topic, "m-1", "k", "poison"),
            message(&topic, "m-2", "k", "fine"),
        ],
    )
    .await;
    let mut sub = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let first = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["m-1"], "the key's first message comes first");
    first[0].terminate().await.expect("terminate");
    let next = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&next), ["m-2"], "terminating releases the key");
    next[0].ack().await.expect("ack");
    let again = receive(sub.as_mut(), 10, SHORT_LEASE * 3).await;
    assert!(
        again.is_empty(),
        "terminated or acked message came back: {:?}",
        ids(&again)
    );
}

/// A message id already published on a topic is accepted and dropped, in
/// the same batch or a later one; the first payload wins. The same id on
/// another topic is a different message.
pub async fn publisher_dedupes_on_message_id<B: Broker>(broker: B) {
    let topic = unique_topic("dedupe");
    let other_topic = unique_topic("dedupe-other");
    declare_groups(&broker, &topic, &["g"]).await;
    declare_groups(&broker, &other_topic, &["g"]).await;
    publish(
        &broker,
        &[
            message(&topic, "m-1", "k-1", "first"),
            message(&topic, "m-1", "k-1", "same batch"),
            message(&topic, "m-2", "k-2", "x"),
        ],
    )
    .await;
    publish(&broker, &[message(&topic, "m-1", "k-1", "later batch")]).await;
    publish(
        &broker,
        &[message(&other_topic, "m-1", "k-1", "other topic")],
    )
    .await;

    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let mut got = collect(sub.as_mut(), 2, PATIENCE).await;
    got.extend(receive(sub.as_mut(), 10, Duration::from_millis(300)).await);
    assert_eq!(ids(&got), ["m-1", "m-2"], "each id delivered once");
    let m1 = got.iter().find(|d| d.message.id == "m-1").expect("m-1");
    assert_eq!(
        m1.message.payload,
        Bytes::from_static(b"first"),
        "the first publish wins"
    );
    ack_all(&got).await;

    let mut other = subscribe(&broker, &other_topic, "g", LONG_LEASE).await;
    let got = collect(other.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&got), ["m-1"], "dedupe is per topic");
    ack_all(&got).await;
}

/// With nothing to deliver, receive waits about `wait` and returns an empty
/// batch; with a zero wait it returns at once.
pub async fn receive_waits_then_returns_empty<B: Broker>(broker: B) {
    let topic = unique_topic("empty");
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let started = clock::now();
    let got = receive(sub.as_mut(), 10, Duration::from_millis(300)).await;
    let waited = started.elapsed();
    assert!(got.is_empty());
    assert!(
        waited >= Duration::from_millis(250),
        "returned early, after {waited:?}"
    );
    assert!(waited < PATIENCE, "waited far too long: {waited:?}");

    let started = clock::now();
    assert!(receive(sub.as_mut(), 10, Duration::ZERO).await.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a zero wait returns promptly"
    );
}

/// A waiting receive returns when a message is published, not at the end of
/// its wait.
pub async fn receive_wakes_on_publish<B: Broker>(broker: B) {
    let topic = unique_topic("wake");
    let broker = Arc::new(broker);
    let mut sub = subscribe(broker.as_ref(), &topic, "g", LONG_LEASE).await;
    let publisher = {
        let broker = broker.clone();
        let topic = topic.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            publish(broker.as_ref(), &[message(&topic, "m-1", "k", "x")]).await;
        })
    };
    let started = clock::now();
    let got = receive(sub.as_mut(), 10, Duration::from_secs(20)).await;
    let waited = started.elapsed();
    publisher.await.expect("publisher panicked");
    assert_eq!(ids(&got), ["m-1"]);
    assert!(
        waited < Duration::from_secs(3),
        "woke only after {waited:?}"
    );
    ack_all(&got).await;
}

/// A receive never returns more than `max` deliveries.
pub async fn receive_respects_max<B: Broker>(broker: B) {
    let topic = unique_topic("max");
    declare_groups(&broker, &topic, &["g"]).await;
    let sent: Vec<Message> = (0..5)
        .map(|i| message(&topic, &format!("m-{i}"), &format!("k-{i}"), "x"))
        .collect();
    publish(&broker, &sent).await;
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let mut got = Vec::new();
    let deadline = clock::now() + PATIENCE;
    while got.len() < sent.len() && clock::now() < deadline {
        let batch = receive(sub.as_mut(), 2, Duration::from_millis(300)).await;
        assert!(batch.len() <= 2, "asked for 2, got {}", batch.len());
        got.extend(batch);
    }
    assert_eq!(ids(&got), ids_of(&sent));
    ack_all(&got).await;
}

/// A group created after messages were published starts where the broker
/// says ([`Broker::group_start`]): at the oldest retained message (it reads
/// them all), or at its creation (it reads only what came after).
pub async fn late_group_receives_retained_messages<B: Broker>(broker: B) {
    let topic = unique_topic("late-group");
    let mut early = subscribe(&broker, &topic, "early", LONG_LEASE).await;
    let sent: Vec<Message> = (0..3)
        .map(|i| message(&topic, &format!("m-{i}"), &format!("k-{i}"), "x"))
        .collect();
    publish(&broker, &sent).await;
    let got = collect(early.as_mut(), 3, PATIENCE).await;
    ack_all(&got).await;

    let mut late = subscribe(&broker, &topic, "late", LONG_LEASE).await;
    let after = message(&topic, "m-after", "k-after", "x");
    publish(&broker, std::slice::from_ref(&after)).await;
    let (expected, why) = match broker.group_start() {
        GroupStart::OldestRetained => (
            ids_of(&[sent, vec![after]].concat()),
            "the late group reads what the topic retains",
        ),
        _ => (
            ids_of(&[after]),
            "the late group reads what was published after its creation",
        ),
    };
    let mut got = collect(late.as_mut(), expected.len(), PATIENCE).await;
    got.extend(receive(late.as_mut(), 10, Duration::from_millis(300)).await);
    assert_eq!(ids(&got), expected, "{why}");
    ack_all(&got).await;
}

/// `ping` answers on a healthy broker.
pub async fn ping_answers<B: Broker>(broker: B) {
    broker.ping().await.expect("ping");
}

/// A group's backlog counts every message it has not finished: nothing at
/// first, everything published, the deliveries it holds as in flight, and
/// a message leaves it when acked. A group that does not exist has none.
pub async fn backlog_counts_what_the_group_has_not_finished<B: Broker>(broker: B) {
    let topic = unique_topic("backlog");
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    assert_eq!(
        backlog_settles_to(&broker, &topic, 0).await,
        Backlog::default()
    );
    let unknown = broker.backlog(&topic, "nobody").await.expect("backlog");
    assert_eq!(unknown, None, "a group that never subscribed");
    publish(
        &broker,
        &[
            message(&topic, "a-1", "a", "1"),
            message(&topic, "b-1", "b", "1"),
            message(&topic, "a-2", "a", "2"),
        ],
    )
    .await;
    backlog_settles_to(&broker, &topic, 3).await;
    let first = collect(sub.as_mut(), 2, PATIENCE).await;
    assert_eq!(ids(&first), ["a-1", "b-1"]);
    let held = backlog_settles_to(&broker, &topic, 3).await;
    assert!(
        held.in_flight >= 2,
        "the two deliveries are in flight: {held:?}"
    );
    ack_all(&first).await;
    backlog_settles_to(&broker, &topic, 1).await;
    let last = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&last), ["a-2"]);
    ack_all(&last).await;
    assert_eq!(
        backlog_settles_to(&broker, &topic, 0).await,
        Backlog::default()
    );
}

/// Group `g`'s backlog once its total is `total` (brokers may count a
/// moment late); fails the test if it never gets there.
async fn backlog_settles_to<B: Broker>(broker: &B, topic: &str, total: u64) -> Backlog {
    let deadline = clock::now() + PATIENCE;
    loop {
        let backlog = broker
            .backlog(topic, "g")
            .await
            .expect("backlog")
            .expect("the group exists once subscribed");
        if backlog.total() == total {
            return backlog;
        }
        assert!(
            clock::now() < deadline,
            "the backlog stayed at {backlog:?}, not {total} in all"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ids_of(messages: &[Message]) -> Vec<String> {
    let mut ids: Vec<String> = messages.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    ids
}

/// Each delivery says when the broker received its message (the
/// CloudEvents `time`, as opposed to the producer's `occurredAt`): within
/// the publish call that stored it, later for a later message, and the same
/// on a redelivery.
pub async fn deliveries_say_when_the_broker_received_them<B: Broker>(broker: B) {
    // The broker's clock may keep milliseconds only.
    let slack = chrono::Duration::milliseconds(2);
    let topic = unique_topic("received-at");
    declare_groups(&broker, &topic, &["reader"]).await;
    let mut windows = Vec::new();
    for id in ["m-1", "m-2"] {
        let before = clock::utc_now();
        publish(&broker, &[message(&topic, id, id, "x")]).await;
        windows.push((before - slack, clock::utc_now() + slack));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut sub = subscribe(&broker, &topic, "reader", LONG_LEASE).await;
    let got = collect(sub.as_mut(), 2, PATIENCE).await;
    assert_eq!(ids(&got), ["m-1", "m-2"]);
    let times: Vec<_> = got
        .iter()
        .map(|d| {
            d.received_at()
                .expect("a delivery says when the broker received it")
        })
        .collect();
    for (at, (from, to)) in times.iter().zip(&windows) {
        assert!(
            from <= at && at <= to,
            "received at {at}, outside its publish call ({from} .. {to})"
        );
    }
    assert!(times[0] < times[1], "a later message was received later");
    got[0]
        .nack(Duration::ZERO)
        .await
        .expect("nack of a leased delivery");
    got[1].ack().await.expect("ack of a leased delivery");
    let again = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(
        again[0].received_at(),
        Some(times[0]),
        "a redelivery keeps its receipt time"
    );
    ack_all(&again).await;
}

/// The broker says how long it keeps what it stored, so what refers to a
/// message from outside it (a claim-checked payload) can outlive it.
pub async fn the_broker_says_how_long_it_keeps_messages<B: Broker>(broker: B) {
    assert_ne!(
        broker.retention(),
        keel_store::broker::MessageRetention::Unknown,
        "a conformant broker declares its retention"
    );
}
