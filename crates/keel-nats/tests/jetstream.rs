//! NATS-specific behaviour of [`NatsBroker`] beyond the conformance suite:
//! dedupe across connections, server-side nak delays and in-progress acks,
//! per-key order across separate connections, releasing held-back messages
//! on shutdown, a failed head check, and a nats-server restart in the
//! middle of a run.
//!
//! [`NatsBroker`]: keel_nats::NatsBroker

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{ServerLock, fresh_broker, test_options};
use keel_core::clock;
use keel_store::broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};
use keel_testkit::broker_suite::OrderChecker;
use keel_testkit::services::{self, Service};
use tokio::sync::Mutex;

const LONG_LEASE: Duration = Duration::from_secs(30);

async fn collect(sub: &mut dyn Subscription, n: usize, within: Duration) -> Vec<Delivery> {
    let deadline = clock::now() + within;
    let mut got = Vec::new();
    while got.len() < n && clock::now() < deadline {
        let wait = (deadline - clock::now()).min(Duration::from_millis(500));
        got.extend(sub.receive(n - got.len(), wait).await.expect("receive"));
    }
    got
}

fn ids(deliveries: &[Delivery]) -> Vec<String> {
    let mut ids: Vec<String> = deliveries.iter().map(|d| d.message.id.clone()).collect();
    ids.sort();
    ids
}

fn sub_options(topic: &str, group: &str, lease: Duration) -> SubscribeOptions {
    SubscribeOptions::new(topic, group).lease(lease)
}

/// A head check that fails (a direct get the server did not answer) keeps
/// the message for the next receive: it is not left unsettled for the
/// server to redeliver a whole ack wait later, holding its key's later
/// messages back as long.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_head_check_keeps_the_message() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker
        .publish(&[Message::new("m-1", "orders", "k-1", "x")])
        .await
        .expect("publish");
    let mut sub = broker
        .subscribe(sub_options("orders", "g", LONG_LEASE))
        .await
        .expect("subscribe");
    fail::cfg("keel-nats-head-check", "1*return").unwrap();
    let failed = sub.receive(1, Duration::from_secs(2)).await;
    fail::remove("keel-nats-head-check");
    assert!(failed.is_err(), "{failed:?}");
    let got = collect(sub.as_mut(), 1, Duration::from_secs(3)).await;
    assert_eq!(ids(&got), ["m-1"], "well inside the 30 s ack wait");
}

/// A republish of the same ids through a *new* connection (a restarted
/// publisher) is dropped by JetStream's duplicate window: one copy each,
/// the first payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_dedupe_holds_across_connections() {
    let Some(first) = fresh_broker().await else {
        return;
    };
    let topic = "orders";
    let batch = |payload: &str| -> Vec<Message> {
        (0..5)
            .map(|i| {
                Message::new(
                    format!("m-{i}"),
                    topic,
                    format!("k-{i}"),
                    payload.to_owned(),
                )
            })
            .collect()
    };
    first.publish(&batch("first")).await.expect("publish");
    let second = first
        .broker
        .options()
        .clone()
        .open(&first.url)
        .await
        .expect("a second connection");
    let mut again = batch("second");
    again.push(Message::new("m-5", topic, "k-5", "new"));
    second.publish(&again).await.expect("republish");

    let mut sub = second
        .subscribe(sub_options(topic, "g", LONG_LEASE))
        .await
        .expect("subscribe");
    let mut got = collect(sub.as_mut(), 6, Duration::from_secs(5)).await;
    got.extend(
        sub.receive(10, Duration::from_millis(300))
            .await
            .expect("receive"),
    );
    assert_eq!(ids(&got), ["m-0", "m-1", "m-2", "m-3", "m-4", "m-5"]);
    for delivery in &got {
        if delivery.message.id != "m-5" {
            assert_eq!(delivery.message.payload, Bytes::from_static(b"first"));
        }
        delivery.ack().await.expect("ack");
    }
}

/// A nak with a delay is held by the server for the whole delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nak_delay_is_honoured() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker
        .publish(&[Message::new("m-1", "jobs", "k", "x")])
        .await
        .expect("publish");
    let mut sub = broker
        .subscribe(sub_options("jobs", "g", LONG_LEASE))
        .await
        .expect("subscribe");
    let first = collect(sub.as_mut(), 1, Duration::from_secs(5)).await;
    assert_eq!(ids(&first), ["m-1"]);
    let delay = Duration::from_millis(1500);
    let nacked_at = clock::now();
    first[0].nack(delay).await.expect("nack");
    let early = sub
        .receive(10, Duration::from_millis(1200))
        .await
        .expect("receive");
    assert!(early.is_empty(), "redelivered inside the nak delay");
    let again = collect(sub.as_mut(), 1, Duration::from_secs(5)).await;
    assert_eq!(ids(&again), ["m-1"]);
    assert!(clock::now() + Duration::from_millis(25) >= nacked_at + delay);
    assert_eq!(again[0].delivery_count, 2);
    again[0].ack().await.expect("ack");
}

/// In-progress acks keep a delivery from the rest of the group for far
/// longer than the consumer's ack wait, and its holder can still ack it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_acks_outlast_the_ack_wait() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    let ack_wait = Duration::from_millis(400);
    broker
        .publish(&[Message::new("m-1", "slow", "k", "x")])
        .await
        .expect("publish");
    let mut holder = broker
        .subscribe(sub_options("slow", "g", ack_wait))
        .await
        .expect("subscribe");
    let mut other = broker
        .subscribe(sub_options("slow", "g", ack_wait))
        .await
        .expect("subscribe");
    let first = collect(holder.as_mut(), 1, Duration::from_secs(5)).await;
    assert_eq!(ids(&first), ["m-1"]);
    first[0]
        .extend_lease(Duration::from_secs(3))
        .await
        .expect("extend");
    // Five ack waits later the other member still has seen nothing.
    let seen = other.receive(10, ack_wait * 5).await.expect("receive");
    assert!(seen.is_empty(), "delivered during an extended lease");
    first[0].ack().await.expect("the holder's ack stands");
    let after = other.receive(10, ack_wait * 3).await.expect("receive");
    assert!(after.is_empty(), "an acked message came back");
}

/// Two connections (think: two processes) in one group: per-key order and
/// one holder at a time hold across them, with nacks mixed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_across_connections() {
    const MESSAGES: usize = 240;
    let Some(first) = fresh_broker().await else {
        return;
    };
    let second = first
        .broker
        .options()
        .clone()
        .open(&first.url)
        .await
        .expect("a second connection");
    let topic = "accounts";
    let messages: Vec<Message> = (0..MESSAGES)
        .map(|i| Message::new(format!("m-{i:04}"), topic, format!("acct-{}", i % 6), "x"))
        .collect();
    let checker = Arc::new(Mutex::new(OrderChecker::new()));
    for message in &messages {
        checker.lock().await.published(message);
    }
    let subs = [
        first
            .subscribe(sub_options(topic, "g", LONG_LEASE))
            .await
            .expect("subscribe"),
        second
            .subscribe(sub_options(topic, "g", LONG_LEASE))
            .await
            .expect("subscribe"),
    ];
    first.publish(&messages).await.expect("publish");
    let mut workers = Vec::new();
    for (consumer, mut sub) in subs.into_iter().enumerate() {
        let checker = checker.clone();
        workers.push(tokio::spawn(async move {
            let deadline = clock::now() + Duration::from_secs(60);
            let mut turn = consumer;
            while checker.lock().await.acked_count() < MESSAGES && clock::now() < deadline {
                let batch = sub
                    .receive(8, Duration::from_millis(100))
                    .await
                    .expect("receive");
                for delivery in &batch {
                    checker.lock().await.delivered(consumer, &delivery.message);
                }
                for delivery in batch {
                    turn += 1;
                    let nack = delivery.delivery_count == 1 && turn % 7 == 0;
                    checker.lock().await.settling(&delivery.message, !nack);
                    if nack {
                        delivery.nack(Duration::ZERO).await.expect("nack");
                    } else {
                        delivery.ack().await.expect("ack");
                    }
                }
            }
        }));
    }
    for worker in workers {
        worker.await.expect("worker panicked");
    }
    if let Err(problems) = checker.lock().await.verify() {
        panic!("order broken across connections:\n{problems}");
    }
}

/// Dropping a subscription hands the messages it held back (behind an
/// earlier message of their key) to the rest of the group at once, not
/// after the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_subscription_releases_what_it_held_back() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    let topic = "shutdown";
    broker
        .publish(&[
            Message::new("k-1", topic, "k", "1"),
            Message::new("k-2", topic, "k", "2"),
        ])
        .await
        .expect("publish");
    let mut leaving = broker
        .subscribe(sub_options(topic, "g", LONG_LEASE))
        .await
        .expect("subscribe");
    let first = collect(leaving.as_mut(), 1, Duration::from_secs(5)).await;
    assert_eq!(ids(&first), ["k-1"]);
    // k-2 was pulled in the same batch and is held back behind k-1.
    first[0].ack().await.expect("ack");
    drop(first);
    drop(leaving);
    let mut staying = broker
        .subscribe(sub_options(topic, "g", LONG_LEASE))
        .await
        .expect("subscribe");
    let started = clock::now();
    let next = collect(staying.as_mut(), 1, Duration::from_secs(10)).await;
    assert_eq!(ids(&next), ["k-2"]);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "k-2 waited for the 30 s lease"
    );
    next[0].ack().await.expect("ack");
}

/// nats-server restarts while a publisher and a consumer run: the client
/// reconnects, and every message takes effect exactly once and in per-key
/// order (keel-testkit's outage scenario).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_loses_nothing() {
    let Some(url) = services::nats_url() else {
        return;
    };
    let _exclusive = ServerLock::exclusive().await;
    let broker = Arc::new(test_options().open(&url).await.expect("connect"));
    let restart = || services::restart(Service::Nats).expect("restart nats-server");
    let publish_errors =
        keel_testkit::broker_suite::an_outage_under_load_loses_nothing(broker, restart).await;
    eprintln!("publish retries during the restart: {publish_errors}");
}
