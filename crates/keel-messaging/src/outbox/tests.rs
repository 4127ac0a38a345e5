//! The outbox and relay against in-memory backends, with paused time.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{TraceParent, clock};

use super::*;
use crate::broker::header;
use crate::consumer::testing::{MemBroker, MemStore};
use crate::store::{OutboxAdminStore, Store};

const TOPIC: &str = "orders";

/// Serialises tests that run relays: failpoints are process-global.
fn serial() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}

fn event(subject: &str) -> Envelope {
    let mut env = Envelope::new("/services/orders", "shop.order.placed.v1");
    env.subject = Some(subject.to_owned());
    env.data = Some(serde_json::json!({ "orderId": subject }));
    env
}

fn relay(outbox: &Outbox<MemStore>, broker: &MemBroker) -> RelayBuilder<MemStore, MemBroker> {
    OutboxRelay::builder(outbox, Arc::new(broker.clone()))
}

/// Appends `subjects` in one committed business transaction.
async fn place(outbox: &Outbox<MemStore>, subjects: &[&str]) -> Vec<Envelope> {
    let envs: Vec<_> = subjects.iter().map(|s| event(s)).collect();
    let mut tx = outbox.store().begin().await.unwrap();
    outbox.append_all(&mut tx, TOPIC, &envs).await.unwrap();
    outbox.commit(tx).await.unwrap();
    envs
}

#[test]
fn the_record_carries_event_id_key_and_trace() {
    let outbox = Outbox::new(MemStore::default());
    let mut env = event("A-4471");
    env.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    env.tracestate = Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".into());
    let record = outbox.record(TOPIC, &env).unwrap();
    assert_eq!(record.event_id, env.id, "event id on the row");
    assert_eq!(
        record.partition_key, "A-4471",
        "subject is the partition key"
    );
    let msg = record.to_message();
    assert_eq!(msg.id, env.id);
    assert_eq!(
        msg.header(header::EVENT_ID),
        Some(env.id.as_str()),
        "and on the message"
    );
    let producer: TraceParent = msg.header(header::TRACEPARENT).unwrap().parse().unwrap();
    let made_in = env.trace_parent().unwrap();
    assert_eq!(producer.trace_id(), made_in.trace_id(), "the event's trace");
    assert_ne!(
        producer.parent_id(),
        made_in.parent_id(),
        "the producer span's own id, a child of the one it was made in"
    );
    assert_eq!(msg.header(header::TRACESTATE), env.tracestate.as_deref());
    assert_eq!(msg.header(header::EVENT_TYPE), Some("shop.order.placed.v1"));
    let stored = Envelope::from_json(&msg.payload).unwrap();
    assert_eq!(
        stored.traceparent.as_deref(),
        msg.header(header::TRACEPARENT)
    );
    assert_eq!(
        Envelope {
            traceparent: env.traceparent.clone(),
            ..stored
        },
        env,
        "everything else as given"
    );
}

#[test]
fn oversized_and_invalid_events_are_refused() {
    let outbox = Outbox::new(MemStore::default()).with_max_size(1024);
    let mut big = event("A-1");
    big.data = Some(serde_json::Value::String("x".repeat(2048)));
    let err = outbox.record(TOPIC, &big).unwrap_err();
    assert!(matches!(
        err,
        OutboxError::Envelope(EnvelopeError::TooLarge { .. })
    ));
    assert!(err.to_string().contains("claim check"), "{err}");
    let unversioned = Envelope::new("/s", "shop.order.placed");
    assert!(outbox.record(TOPIC, &unversioned).is_err());
}

#[tokio::test(start_paused = true)]
async fn the_relay_publishes_in_id_order_and_marks_published() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let first = place(&outbox, &["A", "B", "A"]).await;
    let second = place(&outbox, &["C"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 4);
    assert_eq!(relay.run_once().await.unwrap(), 0, "nothing left");
    let published: Vec<_> = broker.log(TOPIC).into_iter().map(|m| m.id).collect();
    let expected: Vec<_> = first.iter().chain(&second).map(|e| e.id.clone()).collect();
    assert_eq!(published, expected);
    assert_eq!(store.unpublished(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_aborted_business_transaction_is_never_published() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let mut tx = store.begin().await.unwrap();
    outbox.append(&mut tx, TOPIC, &event("X")).await.unwrap();
    store.rollback(tx).await.unwrap();
    let relay = relay(&outbox, &broker).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 0);
    assert!(broker.log(TOPIC).is_empty());
    assert_eq!(store.outbox_len(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_broker_failure_releases_the_claim_and_the_next_round_publishes() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["A"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    broker.fail_next_publishes(1);
    assert!(matches!(relay.run_once().await, Err(RelayError::Broker(_))));
    // Released, not left to the lease: a second relay may take it at once.
    let other = super::OutboxRelay::builder(&outbox, Arc::new(broker.clone()))
        .name("other")
        .build()
        .unwrap();
    assert_eq!(other.run_once().await.unwrap(), 1);
    assert_eq!(broker.log(TOPIC)[0].id, envs[0].id);
}

fn ids(envs: &[Envelope]) -> Vec<String> {
    envs.iter().map(|e| e.id.clone()).collect()
}

fn published(broker: &MemBroker) -> Vec<String> {
    broker.log(TOPIC).into_iter().map(|m| m.id).collect()
}

/// Issue 11: one row the broker refuses for good used to fail the whole
/// batch, every round, forever. Now it is parked, every other row is
/// published, and only the later rows of its own key wait behind it.
#[tokio::test(start_paused = true)]
async fn a_row_the_broker_refuses_is_parked_and_every_other_row_is_published() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    broker.refuse_key_on_publish("POISON");
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["A", "POISON", "B", "POISON", "C"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();

    assert_eq!(relay.run_once().await.unwrap(), 3, "A, B and C go out");
    assert_eq!(
        published(&broker),
        [envs[0].id.clone(), envs[2].id.clone(), envs[4].id.clone()]
    );
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap(), 0, "no retry loop");
    }
    let stats = store.outbox_stats().await.unwrap();
    assert_eq!(stats.parked, 1, "the refused row is parked");
    assert_eq!(
        stats.unpublished, 1,
        "the later row of its key waits behind it"
    );
    let parked = store
        .outbox_parked(&crate::store::ParkedFilter::default())
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].record.event_id, envs[1].id);
    assert_eq!(parked[0].attempts, 1);
    assert_eq!(parked[0].held_back, 1);
    assert!(
        parked[0].last_error.contains("refused"),
        "{}",
        parked[0].last_error
    );
    assert_eq!(
        store.attempts(&envs[3].id),
        Some(0),
        "held back, not failed"
    );
}

/// A row the broker's `validate` refuses is parked without being sent,
/// and the rest of the batch goes out in one publish.
#[tokio::test(start_paused = true)]
async fn a_row_refused_by_validate_is_parked_before_the_batch_is_sent() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    broker.refuse_key_on_validate("bad\nkey");
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["A", "bad\nkey", "B", "bad\nkey"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(
        broker.publish_batches(),
        1,
        "one batch, no row-by-row retry"
    );
    assert_eq!(published(&broker), [envs[0].id.clone(), envs[2].id.clone()]);
    assert_eq!(store.outbox_stats().await.unwrap().parked, 1);
}

/// Replaying a parked row publishes it, and then the rows of its key that
/// waited behind it, in their order.
#[tokio::test(start_paused = true)]
async fn a_replayed_row_is_published_before_the_rows_of_its_key() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    broker.refuse_key_on_publish("K");
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["K", "K", "X"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1, "only X");
    let parked = store.outbox_parked(&Default::default()).await.unwrap();
    assert_eq!(parked.len(), 1);

    // The operator fixed the broker side, then replays.
    broker.allow_all();
    assert!(store.outbox_unpark(parked[0].id).await.unwrap());
    assert!(
        !store.outbox_unpark(parked[0].id).await.unwrap(),
        "only once"
    );
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(
        published(&broker),
        [envs[2].id.clone(), envs[0].id.clone(), envs[1].id.clone()],
        "the replayed row first, then the one behind it"
    );
    let stats = store.outbox_stats().await.unwrap();
    assert_eq!((stats.unpublished, stats.parked), (0, 0));
}

/// Discarding a parked row drops it for good and frees its key.
#[tokio::test(start_paused = true)]
async fn a_discarded_row_frees_its_key() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    broker.refuse_key_on_validate("K");
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["K"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 0);
    broker.allow_all();
    let later = place(&outbox, &["K"]).await;
    assert_eq!(
        relay.run_once().await.unwrap(),
        0,
        "held behind the parked row"
    );
    let parked = store.outbox_parked(&Default::default()).await.unwrap();
    assert!(store.outbox_discard(parked[0].id).await.unwrap());
    assert_eq!(relay.run_once().await.unwrap(), 1);
    assert_eq!(published(&broker), ids(&later));
    assert!(!published(&broker).contains(&envs[0].id), "never published");
    assert_eq!(store.outbox_stats().await.unwrap().parked, 0);
}

/// A failure that may pass is retried, never parked, and each row counts
/// its attempts.
#[tokio::test(start_paused = true)]
async fn transient_failures_count_attempts_and_never_park() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["A", "B"]).await;
    let relay = relay(&outbox, &broker).build().unwrap();
    broker.fail_next_publishes(3);
    for _ in 0..3 {
        assert!(matches!(relay.run_once().await, Err(RelayError::Broker(_))));
    }
    assert_eq!(store.attempts(&envs[0].id), Some(3));
    assert_eq!(store.attempts(&envs[1].id), Some(3));
    assert_eq!(store.outbox_stats().await.unwrap().parked, 0);
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(published(&broker), ids(&envs));
}

/// With the broker's rules, `append` refuses an event the broker could
/// never publish with a typed error, before anything is written.
#[tokio::test(start_paused = true)]
async fn append_refuses_what_the_broker_can_never_accept() {
    let (store, broker) = (MemStore::default(), MemBroker::default());
    broker.refuse_key_on_validate("bad\nkey");
    let outbox = Outbox::new(store.clone()).with_broker(Arc::new(broker.clone()));
    let mut tx = store.begin().await.unwrap();
    let bad = event("bad\nkey");
    let err = outbox.append(&mut tx, TOPIC, &bad).await.unwrap_err();
    let OutboxError::Unpublishable {
        event_id,
        key,
        reason,
        ..
    } = &err
    else {
        panic!("expected Unpublishable, got {err:?}");
    };
    assert_eq!(event_id, &bad.id);
    assert_eq!(key, "bad\nkey");
    assert!(matches!(reason, BrokerError::Invalid(_)));
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(err.to_string().contains("fix its key"), "{err}");
    let err = outbox
        .append_all(&mut tx, TOPIC, &[event("A"), bad.clone()])
        .await
        .unwrap_err();
    assert!(matches!(err, OutboxError::Unpublishable { .. }));
    // The transaction is still usable; the good event commits alone.
    outbox.append(&mut tx, TOPIC, &event("A")).await.unwrap();
    outbox.commit(tx).await.unwrap();
    assert_eq!(store.outbox_len(), 1, "nothing of the refused event");
}

#[tokio::test(start_paused = true)]
async fn a_row_behind_a_claimed_one_is_not_skipped() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let envs = place(&outbox, &["A", "B"]).await;
    // Relay one claims row 1 and dies holding it.
    let lease = Duration::from_secs(5);
    let _claimed = store.outbox_claim("dead-relay", 1, lease).await.unwrap();
    let relay = relay(&outbox, &broker).lease(lease).build().unwrap();
    assert_eq!(
        relay.run_once().await.unwrap(),
        1,
        "row 2 (another key) goes ahead"
    );
    tokio::time::advance(lease).await;
    assert_eq!(
        relay.run_once().await.unwrap(),
        1,
        "row 1 is still found later"
    );
    let published: Vec<_> = broker.log(TOPIC).into_iter().map(|m| m.id).collect();
    assert_eq!(published, [envs[1].id.clone(), envs[0].id.clone()]);
}

#[tokio::test(start_paused = true)]
async fn commit_wakes_the_relay_before_the_poll_interval() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    let relay = relay(&outbox, &broker)
        .poll_interval(Duration::from_secs(3600))
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.await;
            })
            .await;
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = clock::now();
    place(&outbox, &["A"]).await;
    while broker.log(TOPIC).is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        clock::now() - started < Duration::from_secs(1),
        "woken, not polled"
    );
    let _ = stop.send(());
    running.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn run_backs_off_after_failures_and_recovers() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    place(&outbox, &["A", "B"]).await;
    broker.fail_next_publishes(3);
    let backoff = keel_policy::retry::Backoff::exponential(
        Duration::from_secs(1),
        2.0,
        Duration::from_secs(60),
    )
    .unwrap()
    .with_jitter(keel_policy::retry::Jitter::None)
    .unwrap();
    let relay = relay(&outbox, &broker).backoff(backoff).build().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = clock::now();
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.await;
            })
            .await;
    });
    while store.unpublished() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // 1 s + 2 s + 4 s of backoff, not a hot loop, and not given up.
    assert!(clock::now() - started >= Duration::from_secs(7));
    assert_eq!(broker.log(TOPIC).len(), 2);
    let _ = stop.send(());
    running.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn prune_deletes_old_published_rows_in_bounded_batches() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let outbox = Outbox::new(store.clone());
    place(&outbox, &["A", "B", "C", "D", "E"]).await;
    let relay = relay(&outbox, &broker)
        .prune_batch(NonZeroUsize::new(2).unwrap())
        .build()
        .unwrap();
    relay.run_once().await.unwrap();
    place(&outbox, &["F"]).await; // unpublished: never pruned
    assert_eq!(relay.prune_once().await.unwrap(), 0, "too young to prune");
    store.age_published(chrono::Duration::days(8));
    let calls_before = store.prune_calls();
    assert_eq!(relay.prune_once().await.unwrap(), 5);
    assert_eq!(store.prune_calls() - calls_before, 3, "2 + 2 + 1");
    assert_eq!(store.outbox_len(), 1);
}

#[test]
fn build_refuses_zero_durations() {
    let outbox = Outbox::new(MemStore::default());
    let broker = MemBroker::default();
    let err = relay(&outbox, &broker)
        .poll_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field, "poll_interval");
    assert_eq!(
        relay(&outbox, &broker)
            .lease(Duration::ZERO)
            .build()
            .unwrap_err()
            .field,
        "lease"
    );
    let ok = relay(&outbox, &broker).build().unwrap();
    assert_eq!(ok.options().poll_interval, DEFAULT_POLL_INTERVAL);
    assert_eq!(ok.options().retention, Duration::from_secs(7 * 86_400));
}

#[cfg(feature = "failpoints")]
mod crashes {
    use super::*;
    use crate::broker::Broker;
    use crate::consumer::testing::MemTx;
    use crate::consumer::{Consumer, Group};

    /// The classic outbox test: the relay crashes after publishing, before marking;
    /// a restarted relay republishes; the consumer applies once.
    #[tokio::test(start_paused = true)]
    async fn the_outbox_republishes_after_a_relay_crash_and_the_consumer_applies_once() {
        let _serial = serial();
        let (store, broker) = (MemStore::default(), MemBroker::default());
        let outbox = Outbox::new(store.clone());
        let env = place(&outbox, &["A-4471"]).await.remove(0);
        let lease = Duration::from_millis(500);
        fail::cfg("relay-after-publish", "1*return").unwrap();
        let crashed = relay(&outbox, &broker).lease(lease).build().unwrap();
        assert!(matches!(
            crashed.run_once().await,
            Err(RelayError::Crashed("relay-after-publish"))
        ));
        drop(crashed);
        assert_eq!(store.unpublished(), 1, "published but not marked");

        let restarted = relay(&outbox, &broker).lease(lease).build().unwrap();
        assert_eq!(
            restarted.run_once().await.unwrap(),
            0,
            "claimed until the lease ends"
        );
        tokio::time::advance(lease).await;
        assert_eq!(restarted.run_once().await.unwrap(), 1);
        assert_eq!(broker.publish_calls(&env.id), 2, "at-least-once");
        assert_eq!(store.unpublished(), 0);

        let group =
            Group::new(TOPIC, "billing").on_fn("shop.order.placed.v1", |tx: &mut MemTx, env| {
                let subject = env.subject.clone().unwrap_or_default();
                Box::pin(async move {
                    tx.effects.push(subject);
                    Ok(())
                })
            });
        // Deliver both publishes, as a broker without publisher dedupe would.
        let copy = broker.log(TOPIC)[0].clone();
        let mut dup = copy.clone();
        dup.id = format!("{}-republished", copy.id);
        broker.publish(&[dup]).await.unwrap();
        let consumer = Consumer::builder(store.clone(), Arc::new(broker.clone()))
            .group(group)
            .build()
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        while !broker.all_done(TOPIC, "billing") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = stop.send(());
        running.await.unwrap();
        assert_eq!(store.ledger(), ["A-4471"], "applied once");
    }

    #[tokio::test(start_paused = true)]
    async fn crashes_at_each_relay_step_lose_nothing() {
        for point in [
            "relay-after-claim",
            "relay-after-publish",
            "relay-after-mark",
        ] {
            let _serial = serial();
            let (store, broker) = (MemStore::default(), MemBroker::default());
            let outbox = Outbox::new(store.clone());
            let envs = place(&outbox, &["A", "B", "A"]).await;
            let lease = Duration::from_millis(200);
            fail::cfg(point, "1*return").unwrap();
            let crashed = relay(&outbox, &broker).lease(lease).build().unwrap();
            assert!(crashed.run_once().await.is_err(), "{point}");
            drop(crashed);
            tokio::time::advance(lease).await;
            let restarted = relay(&outbox, &broker).lease(lease).build().unwrap();
            while restarted.run_once().await.unwrap() > 0 {}
            let published: Vec<_> = broker.log(TOPIC).into_iter().map(|m| m.id).collect();
            let expected: Vec<_> = envs.iter().map(|e| e.id.clone()).collect();
            assert_eq!(
                published, expected,
                "all, once each on the broker, in order: {point}"
            );
            assert_eq!(store.unpublished(), 0);
        }
    }
}
