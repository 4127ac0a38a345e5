//! The consumer runtime against in-memory backends, with paused time.

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_policy::retry::{Backoff, Jitter};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::testing::{MemBroker, MemStore, MemTx};
use super::*;
use crate::broker::{Broker, Message, header};
use crate::dead_letter::{self, kind};
use crate::envelope::{Event, EventMeta};
use crate::outbox::Outbox;
use crate::store::{DeadLetterStatus, DeadLetterStore};

mod observed;

const TOPIC: &str = "payments";
const GROUP: &str = "billing";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChargeRequested {
    order: String,
    amount: i64,
}

impl Event for ChargeRequested {
    const TYPE: &'static str = "shop.charge.requested.v1";
    fn subject(&self) -> String {
        self.order.clone()
    }
}

/// Serialises tests that run consumers: failpoints are process-global.
fn serial() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}

fn charge(order: &str, amount: i64) -> Envelope {
    let event = ChargeRequested {
        order: order.into(),
        amount,
    };
    Envelope::from_event("/test", &event, EventMeta::new(1)).unwrap()
}

fn message(env: &Envelope) -> Message {
    Outbox::new(MemStore::default())
        .record(TOPIC, env)
        .unwrap()
        .to_message()
}

/// `n` messages of one event, each with its own message id.
fn copies(env: &Envelope, n: usize) -> impl Iterator<Item = Message> + '_ {
    (0..n).map(move |i| {
        let mut m = message(env);
        m.id = format!("copy-{i}");
        m
    })
}

async fn publish(broker: &MemBroker, messages: impl IntoIterator<Item = Message>) {
    let messages: Vec<_> = messages.into_iter().collect();
    broker.publish(&messages).await.unwrap();
}

fn ledger_group() -> Group<MemTx> {
    Group::new(TOPIC, GROUP).on_event(|tx: &mut MemTx, ev: ChargeRequested, _env| {
        Box::pin(async move {
            tx.effects.push(format!("{}:{}", ev.order, ev.amount));
            Ok(())
        })
    })
}

/// Records each order after `handling` of work.
fn slow_group(handling: Duration) -> Group<MemTx> {
    Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            tokio::time::sleep(handling).await;
            tx.effects.push(ev.order);
            Ok(())
        })
    })
}

fn fast_backoff() -> Backoff {
    Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(1))
        .unwrap()
        .with_jitter(Jitter::None)
        .unwrap()
}

fn builder(store: &MemStore, broker: &MemBroker) -> ConsumerBuilder<MemStore, MemBroker> {
    Consumer::builder(store.clone(), Arc::new(broker.clone()))
        .backoff(fast_backoff())
        .receive_wait(Duration::from_millis(50))
}

/// Runs `consumer` until `done` holds (or two virtual minutes pass), then
/// shuts it down.
async fn run_until(
    consumer: Consumer<MemStore, MemBroker>,
    done: impl Fn() -> bool,
) -> ShutdownReport {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    let give_up = clock::now() + Duration::from_secs(120);
    while !done() {
        assert!(clock::now() < give_up, "condition not reached in time");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    running.await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn applies_once_under_triple_delivery() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    // Redelivery, relay republish, rebalance: three messages, one event id.
    publish(&broker, copies(&charge("A-1", 8210), 3)).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["A-1:8210"], "charged ONCE");
}

#[tokio::test(start_paused = true)]
async fn retryable_failures_are_redelivered_with_backoff() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let msg = message(&charge("A-1", 5));
    publish(&broker, [msg.clone()]).await;
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = Arc::clone(&calls);
    let group = Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            let n = {
                let mut calls = seen.lock();
                calls.push(clock::now());
                calls.len()
            };
            if n < 3 {
                return Err(HandlerError::retryable("payments API unavailable"));
            }
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["A-1"]);
    assert_eq!(broker.delivery_counts(TOPIC, GROUP), [3]);
    let calls = calls.lock().clone();
    // Exponential: 100 ms after the first failure, 200 ms after the second.
    assert!(calls[1] - calls[0] >= Duration::from_millis(100));
    assert!(calls[2] - calls[1] >= Duration::from_millis(200));
    assert!(store.letters().is_empty());
    let history = store.failure_history(GROUP, &msg.id).await.unwrap();
    assert!(history.is_empty(), "the history is forgotten after success");
}

#[tokio::test(start_paused = true)]
async fn a_poison_message_is_dead_lettered_with_its_history_and_blocks_no_other_key() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let poison = message(&charge("POISON", 1));
    let others: Vec<_> = (0..5)
        .map(|i| message(&charge(&format!("B-{i}"), i)))
        .collect();
    publish(&broker, std::iter::once(poison.clone()).chain(others)).await;
    let group = Group::new(TOPIC, GROUP).on_event(|tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            if ev.order == "POISON" {
                return Err(HandlerError::retryable(std::io::Error::other("boom")));
            }
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;

    assert_eq!(store.ledger().len(), 5, "other keys were applied");
    let letters = store.letters();
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.error_kind, kind::TOO_MANY_ATTEMPTS);
    assert_eq!(letter.message, poison);
    assert_eq!(letter.group, GROUP);
    let attempts: Vec<u32> = letter.attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(
        attempts,
        [1, 2, 3, 4, 5],
        "the full history travels with it"
    );
    assert!(letter.attempts.iter().all(|a| a.error.contains("boom")));
    assert_eq!(
        broker.delivery_counts(TOPIC, GROUP),
        [5, 1, 1, 1, 1, 1],
        "the other keys went through first time, while the poison was retried"
    );
    assert!(
        store
            .failure_history(GROUP, &poison.id)
            .await
            .unwrap()
            .is_empty(),
        "the history moved into the letter"
    );
}

#[tokio::test(start_paused = true)]
async fn malformed_and_unknown_messages_are_dead_lettered_at_once() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let garbage = Message::new("garbage", TOPIC, "k1", &b"{not json"[..]);
    let mut unknown_env = Envelope::new("/test", "shop.refund.issued.v1");
    unknown_env.subject = Some("k2".into());
    let unknown = message(&unknown_env);
    let mut wrong_shape = Envelope::new("/test", ChargeRequested::TYPE);
    wrong_shape.subject = Some("k3".into());
    wrong_shape.data = Some(serde_json::json!({"order": 42}));
    let wrong_shape = message(&wrong_shape);
    publish(&broker, [garbage, unknown.clone(), wrong_shape.clone()]).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;

    assert_eq!(
        broker.delivery_counts(TOPIC, GROUP),
        [1, 1, 1],
        "no retries"
    );
    let kinds = |id: &str| {
        store
            .letters()
            .into_iter()
            .find(|l| l.message.id == id)
            .map(|l| (l.error_kind, l.attempts.len()))
    };
    assert_eq!(kinds("garbage"), Some((kind::MALFORMED.into(), 1)));
    assert_eq!(kinds(&unknown.id), Some((kind::UNKNOWN_TYPE.into(), 1)));
    assert_eq!(kinds(&wrong_shape.id), Some((kind::MALFORMED.into(), 1)));
    assert!(store.ledger().is_empty());
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_are_dead_lettered_at_once() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("A-1", -5))]).await;
    let group = Group::new(TOPIC, GROUP).on_event(|_tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            Err(HandlerError::permanent(format!(
                "amount must be positive, got {}",
                ev.amount
            )))
        })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let letters = store.letters();
    assert_eq!(letters[0].error_kind, kind::PERMANENT);
    assert!(letters[0].attempts[0].error.contains("must be positive"));
    assert_eq!(broker.delivery_counts(TOPIC, GROUP), [1]);
}

/// A handler files failures under its own error types: a permanent one at
/// once, a retryable one after its deliveries; the store lists, counts and
/// replays by that type. A malformed kind is ignored.
#[tokio::test(start_paused = true)]
async fn a_handler_files_dead_letters_under_its_own_error_type() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let orders = ["declined-1", "declined-2", "fraud-1", "typo-1", "flaky-1"];
    publish(&broker, orders.map(|o| message(&charge(o, 100)))).await;
    let group = Group::new(TOPIC, GROUP).on_event(|_tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            let err = match ev.order.split('-').next() {
                Some("declined") => {
                    HandlerError::permanent("card declined").with_kind("payment_declined")
                }
                Some("fraud") => {
                    HandlerError::permanent("risk score 97").with_kind("fraud.suspected")
                }
                Some("typo") => HandlerError::permanent("bad kind").with_kind("Not A Kind"),
                _ => HandlerError::retryable("payments timed out").with_kind("payments_timeout"),
            };
            Err(err)
        })
    });
    let consumer = builder(&store, &broker)
        .max_deliveries(NonZeroU32::new(2).unwrap())
        .group(group)
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let letters = dead_letter::DeadLetters::new(store.clone());
    let counts = letters.counts().await.unwrap();
    assert_eq!(
        counts,
        [
            ("payment_declined".to_owned(), 2),
            ("fraud.suspected".to_owned(), 1),
            ("payments_timeout".to_owned(), 1),
            (kind::PERMANENT.to_owned(), 1),
        ]
    );
    let declined = crate::store::DeadLetterFilter {
        error_kind: Some("payment_declined".to_owned()),
        ..Default::default()
    };
    let listed = letters.list(&declined).await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(
        listed
            .iter()
            .all(|l| l.attempts[0].error.contains("card declined"))
    );
    let flaky = crate::store::DeadLetterFilter {
        error_kind: Some("payments_timeout".to_owned()),
        ..Default::default()
    };
    assert_eq!(
        letters.list(&flaky).await.unwrap()[0].attempts.len(),
        2,
        "after its deliveries"
    );
    assert_eq!(
        letters.replay_many(&declined).await.unwrap(),
        2,
        "replayed by type"
    );
    let pending: u64 = letters.counts().await.unwrap().iter().map(|(_, n)| n).sum();
    assert_eq!(pending, 3, "the other types wait");
}

#[tokio::test(start_paused = true)]
async fn expired_messages_are_dropped_not_processed() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let past = keel_core::clock::unix_millis() - 1_000;
    let future = keel_core::clock::unix_millis() + 3_600_000;
    let late = message(&charge("LATE", 1)).with_header(header::DEADLINE, past.to_string());
    let timely = message(&charge("TIMELY", 1)).with_header(header::DEADLINE, future.to_string());
    publish(&broker, [late, timely]).await;
    let group = Group::new(TOPIC, GROUP).on_event(|tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            assert!(
                keel_core::Deadline::current().is_some(),
                "runs under the deadline"
            );
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["TIMELY"]);
    assert!(store.letters().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_lease_is_extended_while_a_slow_handler_runs() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("SLOW", 1))]).await;
    let consumer = builder(&store, &broker)
        .lease(Duration::from_millis(300))
        // Ten leases long.
        .group(slow_group(Duration::from_secs(3)))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(
        broker.delivery_counts(TOPIC, GROUP),
        [1],
        "never redelivered"
    );
    assert_eq!(store.ledger(), ["SLOW"]);
}

#[tokio::test(start_paused = true)]
async fn in_flight_work_is_bounded_and_same_key_work_is_ordered() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let msgs = (0..12).map(|i| message(&charge(&format!("K{}", i % 4), i)));
    publish(&broker, msgs).await;
    let running = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let (r, p) = (Arc::clone(&running), Arc::clone(&peak));
    let group = Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        let (running, peak) = (Arc::clone(&r), Arc::clone(&p));
        Box::pin(async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            running.fetch_sub(1, Ordering::SeqCst);
            tx.effects.push(format!("{}:{}", ev.order, ev.amount));
            Ok(())
        })
    });
    let consumer = builder(&store, &broker)
        .max_in_flight(NonZeroUsize::new(2).unwrap())
        .group(group)
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(
        peak.load(Ordering::SeqCst),
        2,
        "never more than max_in_flight"
    );
    let ledger = store.ledger();
    assert_eq!(ledger.len(), 12);
    for key in ["K0", "K1", "K2", "K3"] {
        let amounts: Vec<i64> = ledger
            .iter()
            .filter_map(|e| e.strip_prefix(&format!("{key}:")))
            .map(|a| a.parse().unwrap())
            .collect();
        let mut sorted = amounts.clone();
        sorted.sort_unstable();
        assert_eq!(amounts, sorted, "per-key order for {key}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_idle_group_does_not_sit_on_a_busy_groups_slots() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(
        &broker,
        (0..8).map(|i| message(&charge(&format!("K{i}"), i))),
    )
    .await;
    let running = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let (r, p) = (Arc::clone(&running), Arc::clone(&peak));
    let busy = Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        let (running, peak) = (Arc::clone(&r), Arc::clone(&p));
        Box::pin(async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            running.fetch_sub(1, Ordering::SeqCst);
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let idle = Group::new("quiet-topic", "idle")
        .on_event(|_tx: &mut MemTx, _ev: ChargeRequested, _| Box::pin(async { Ok(()) }));
    let consumer = builder(&store, &broker)
        .max_in_flight(NonZeroUsize::new(2).unwrap())
        .receive_wait(Duration::from_secs(1))
        .group(idle)
        .group(busy)
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(
        peak.load(Ordering::SeqCst),
        2,
        "both slots went to the busy group"
    );
    assert_eq!(store.ledger().len(), 8);
}

#[tokio::test(start_paused = true)]
async fn graceful_shutdown_finishes_in_flight_handlers_and_loses_nothing() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let msgs: Vec<_> = (0..6)
        .map(|i| message(&charge(&format!("G{i}"), i)))
        .collect();
    publish(&broker, msgs).await;
    let started = Arc::new(AtomicU32::new(0));
    let slow_group = |started: Arc<AtomicU32>, pause: Duration| {
        Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
            let started = Arc::clone(&started);
            Box::pin(async move {
                started.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(pause).await;
                tx.effects.push(ev.order);
                Ok(())
            })
        })
    };
    let consumer = builder(&store, &broker)
        .max_in_flight(NonZeroUsize::new(2).unwrap())
        .drain_timeout(Duration::from_secs(10))
        .group(slow_group(Arc::clone(&started), Duration::from_secs(1)))
        .build()
        .unwrap();
    // Shut down as soon as the first handlers are running.
    let s = Arc::clone(&started);
    let report = run_until(consumer, move || s.load(Ordering::SeqCst) >= 2).await;
    assert!(
        report.drained,
        "the running handlers finished within the drain timeout"
    );
    let applied_first = store.ledger().len();
    assert!(
        applied_first >= 2,
        "in-flight handlers completed: {applied_first}"
    );
    assert!(applied_first < 6, "the consumer stopped receiving");

    // A restarted consumer picks up the rest; every event applied once.
    let consumer = builder(&store, &broker)
        .group(slow_group(Arc::default(), Duration::ZERO))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let mut ledger = store.ledger();
    ledger.sort();
    assert_eq!(ledger, ["G0", "G1", "G2", "G3", "G4", "G5"]);
}

#[tokio::test(start_paused = true)]
async fn the_drain_timeout_cancels_and_releases_unfinished_work() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(
        &broker,
        (0..3).map(|i| message(&charge(&format!("H{i}"), i))),
    )
    .await;
    let started = Arc::new(AtomicU32::new(0));
    let st = Arc::clone(&started);
    let stuck = Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        let st = Arc::clone(&st);
        Box::pin(async move {
            st.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3600)).await;
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker)
        .drain_timeout(Duration::from_secs(1))
        .group(stuck)
        .build()
        .unwrap();
    let s = Arc::clone(&started);
    let report = run_until(consumer, move || s.load(Ordering::SeqCst) == 3).await;
    assert!(!report.drained);
    assert_eq!(report.released, 3);
    assert!(store.ledger().is_empty(), "cancelled handlers rolled back");

    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let mut ledger = store.ledger();
    ledger.sort();
    assert_eq!(ledger, ["H0:0", "H1:1", "H2:2"]);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_is_retried_then_dead_lettered() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(
        &broker,
        [message(&charge("PANIC", 1)), message(&charge("OK", 2))],
    )
    .await;
    let group = Group::new(TOPIC, GROUP).on_event(|tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            assert!(ev.order != "PANIC", "handler bug");
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker)
        .max_deliveries(NonZeroU32::new(2).unwrap())
        .group(group)
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["OK"]);
    let letter = &store.letters()[0];
    assert_eq!(letter.error_kind, kind::TOO_MANY_ATTEMPTS);
    assert_eq!(letter.attempts.len(), 2);
    assert!(
        letter.attempts[0]
            .error
            .contains("handler panicked: handler bug")
    );
}

#[tokio::test(start_paused = true)]
async fn replay_from_the_dead_letter_store_is_applied_once_by_its_group_only() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let env = charge("R-1", 70);
    publish(&broker, [message(&env)]).await;
    // `billing` has no handler for the type yet; `audit` applies it.
    let wrong = Group::new(TOPIC, GROUP).on_fn("shop.other.v1", |_tx: &mut MemTx, _env| {
        Box::pin(async { Ok(()) })
    });
    let audit = Group::new(TOPIC, "audit").on_event(|tx: &mut MemTx, ev: ChargeRequested, _| {
        Box::pin(async move {
            tx.effects.push(format!("audit:{}", ev.order));
            Ok(())
        })
    });
    let consumer = builder(&store, &broker)
        .group(wrong)
        .group(audit)
        .build()
        .unwrap();
    run_until(consumer, || {
        broker.all_done(TOPIC, GROUP) && broker.all_done(TOPIC, "audit")
    })
    .await;
    let letter = store.letters().pop().unwrap();
    assert_eq!(letter.error_kind, kind::UNKNOWN_TYPE);

    // Deploy the handler, then replay through the outbox and the relay.
    let outbox = Outbox::new(store.clone());
    let letters = dead_letter::DeadLetters::with_outbox(outbox.clone());
    letters.replay(&letter.id).await.unwrap();
    let relay = crate::outbox::OutboxRelay::builder(&outbox, Arc::new(broker.clone()))
        .build()
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1);
    let replayed = broker.log(TOPIC).pop().unwrap();
    assert_ne!(replayed.id, letter.message.id, "a fresh message id");
    assert_eq!(replayed.header(header::EVENT_ID), Some(env.id.as_str()));

    let audit_again =
        Group::new(TOPIC, "audit").on_event(|tx: &mut MemTx, ev: ChargeRequested, _| {
            Box::pin(async move {
                tx.effects.push(format!("audit-again:{}", ev.order));
                Ok(())
            })
        });
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .group(audit_again)
        .build()
        .unwrap();
    run_until(consumer, || {
        broker.all_done(TOPIC, GROUP) && broker.all_done(TOPIC, "audit")
    })
    .await;
    assert_eq!(store.ledger(), ["audit:R-1", "R-1:70"]);
    let settled = store.dead_letter_get(&letter.id).await.unwrap().unwrap();
    assert_eq!(settled.status, DeadLetterStatus::Replayed);
}

#[tokio::test(start_paused = true)]
async fn a_message_delivered_past_the_limit_is_dead_lettered_without_running() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("CRASHER", 1))]).await;
    // Simulate earlier processes dying mid-handler: take it three times and
    // let the leases lapse without settling.
    let mut sub = broker
        .subscribe(
            crate::broker::SubscribeOptions::new(TOPIC, GROUP).lease(Duration::from_millis(10)),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        let batch = sub.receive(1, Duration::from_secs(1)).await.unwrap();
        assert_eq!(batch.len(), 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let consumer = builder(&store, &broker)
        .max_deliveries(NonZeroU32::new(3).unwrap())
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert!(store.ledger().is_empty());
    assert_eq!(store.letters()[0].error_kind, kind::TOO_MANY_ATTEMPTS);
}

#[test]
fn build_refuses_nonsense() {
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let err = |b: ConsumerBuilder<MemStore, MemBroker>| b.build().unwrap_err().field;
    assert_eq!(err(builder(&store, &broker)), "groups");
    assert_eq!(
        err(builder(&store, &broker).group(Group::new(TOPIC, GROUP))),
        "groups"
    );
    assert_eq!(
        err(builder(&store, &broker)
            .group(ledger_group())
            .group(ledger_group())),
        "groups"
    );
    assert_eq!(
        err(builder(&store, &broker)
            .group(ledger_group())
            .lease(Duration::ZERO)),
        "lease"
    );
}

#[cfg(feature = "failpoints")]
mod crashes {
    use super::*;

    /// Crashes once at `point`, then checks the event is applied exactly once.
    async fn crash_once_at(point: &str) {
        let _serial = serial();
        fail::cfg(point, "1*return").unwrap();
        let (store, broker) = (MemStore::default(), MemBroker::default());
        publish(
            &broker,
            [message(&charge("C-1", 10)), message(&charge("C-2", 20))],
        )
        .await;
        let consumer = builder(&store, &broker)
            .lease(Duration::from_millis(300))
            .group(ledger_group())
            .build()
            .unwrap();
        run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
        let mut ledger = store.ledger();
        ledger.sort();
        assert_eq!(ledger, ["C-1:10", "C-2:20"], "crash at {point}");
        assert!(store.letters().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn crash_after_inbox_insert() {
        crash_once_at("consumer-after-inbox").await;
    }

    #[tokio::test(start_paused = true)]
    async fn crash_after_handler_before_commit() {
        crash_once_at("consumer-after-handler").await;
    }

    #[tokio::test(start_paused = true)]
    async fn crash_after_commit_before_ack() {
        crash_once_at("consumer-after-commit").await;
    }

    #[tokio::test(start_paused = true)]
    async fn crash_after_ack() {
        crash_once_at("consumer-after-ack").await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_crash_between_storing_a_dead_letter_and_terminating_stores_it_once() {
        let _serial = serial();
        fail::cfg("consumer-after-dead-letter", "1*return").unwrap();
        let (store, broker) = (MemStore::default(), MemBroker::default());
        let mut refund = Envelope::new("/test", "shop.refund.issued.v1");
        refund.subject = Some("k".into());
        publish(&broker, [message(&refund)]).await;
        let consumer = builder(&store, &broker)
            .lease(Duration::from_millis(300))
            .group(ledger_group())
            .build()
            .unwrap();
        run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
        assert_eq!(
            broker.delivery_counts(TOPIC, GROUP),
            [2],
            "redelivered after the crash"
        );
        assert_eq!(store.letters().len(), 1, "one letter, not two");
    }

    #[tokio::test(start_paused = true)]
    async fn a_crash_before_the_ack_redelivers_and_the_inbox_dedupes() {
        let _serial = serial();
        fail::cfg("consumer-after-commit", "1*return").unwrap();
        let (store, broker) = (MemStore::default(), MemBroker::default());
        publish(&broker, [message(&charge("D-1", 1))]).await;
        let consumer = builder(&store, &broker)
            .lease(Duration::from_millis(300))
            .group(ledger_group())
            .build()
            .unwrap();
        run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
        assert_eq!(
            broker.delivery_counts(TOPIC, GROUP),
            [2],
            "redelivered once"
        );
        assert_eq!(store.ledger(), ["D-1:1"], "applied once");
    }
}

#[tokio::test(start_paused = true)]
async fn the_handler_sees_the_broker_time_apart_from_occurred_at() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let event = ChargeRequested {
        order: "A-1".into(),
        amount: 5,
    };
    // The fact happened an hour before the message was sent.
    let mut meta = EventMeta::new(1);
    meta.occurred_at = clock::utc_now() - chrono::Duration::hours(1);
    let env = Envelope::from_event("/test", &event, meta).unwrap();
    let before = clock::utc_now() - chrono::Duration::milliseconds(1);
    publish(&broker, [message(&env)]).await;
    let after = clock::utc_now();
    let seen: Arc<Mutex<Vec<Envelope>>> = Arc::default();
    let record = Arc::clone(&seen);
    let group = Group::new(TOPIC, GROUP).on_event(move |_: &mut MemTx, _: ChargeRequested, env| {
        record.lock().push(env.clone());
        Box::pin(async { Ok(()) })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let seen = seen.lock();
    let time = seen[0].time.expect("the broker's receipt time");
    assert!(
        before <= time && time <= after,
        "time {time} is when the broker got it ({before} .. {after})"
    );
    let occurred = seen[0].occurred_at().unwrap();
    assert!(
        time - occurred >= chrono::Duration::minutes(59),
        "occurredAt {occurred} stays when the fact happened"
    );
}

/// Leaves work for after its commit, then fails its first two attempts.
struct LeavesWork {
    attempts: AtomicU32,
    ran: Arc<Mutex<Vec<u32>>>,
}

#[async_trait::async_trait]
impl Handler<MemTx> for LeavesWork {
    async fn handle(
        &self,
        tx: &mut MemTx,
        _envelope: &Envelope,
        info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let ran = Arc::clone(&self.ran);
        info.on_commit(move || ran.lock().push(attempt));
        if attempt < 3 {
            return Err(HandlerError::retryable("not yet"));
        }
        tx.effects.push(format!("attempt {attempt}"));
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn work_left_for_after_the_commit_runs_once_and_only_for_the_attempt_that_committed() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("A-1", 5))]).await;
    let ran: Arc<Mutex<Vec<u32>>> = Arc::default();
    let handler = LeavesWork {
        attempts: AtomicU32::new(0),
        ran: Arc::clone(&ran),
    };
    let group = Group::new(TOPIC, GROUP).on(ChargeRequested::TYPE, handler);
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["attempt 3"]);
    assert_eq!(*ran.lock(), [3], "the rolled-back attempts' work never ran");
}
