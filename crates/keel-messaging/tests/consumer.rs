//! The consumer runtime on the real embedded backends (SqliteStore and
//! SqliteBroker on temporary files): each scenario asserts what protects
//! users — charged once, nothing lost, order kept — not just return values.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use keel_messaging::broker::{
    Broker, BrokerError, Delivery, DeliveryControl, Message, SubscribeOptions, Subscription, header,
};
use keel_messaging::consumer::{
    Backoff, Consumer, ConsumerBuilder, Group, HandlerError, Jitter, ShutdownReport,
};
use keel_messaging::dead_letter::kind;
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::{DeadLetterFilter, DeadLetterStore, Store};
use keel_sqlite::broker::SqliteBroker;
use keel_sqlite::store::SqliteStore;
use keel_testkit::eventually;
use keel_testkit::metrics::MetricsRecorder;
use serde::{Deserialize, Serialize};
use sqlx::Row;
use tempfile::TempDir;

type Tx = <SqliteStore as Store>::Tx;

const TOPIC: &str = "payments";

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

struct Fixture {
    _dir: TempDir,
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
}

async fn fixture() -> Fixture {
    MetricsRecorder::global();
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    sqlx::query(
        "CREATE TABLE ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, grp TEXT NOT NULL,
                              order_id TEXT NOT NULL, amount INTEGER NOT NULL,
                              applied_at INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let broker = Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .unwrap(),
    );
    Fixture {
        _dir: dir,
        store,
        broker,
    }
}

fn charge(order: &str, amount: i64) -> Envelope {
    let event = ChargeRequested {
        order: order.into(),
        amount,
    };
    Envelope::from_event("/services/orders", &event, EventMeta::new(1)).unwrap()
}

fn message(store: &SqliteStore, env: &Envelope) -> Message {
    Outbox::new(store.clone())
        .record(TOPIC, env)
        .unwrap()
        .to_message()
}

/// The effect: a ledger row, written in the consumer's transaction.
async fn write_ledger(
    tx: &mut Tx,
    group: &str,
    order: &str,
    amount: i64,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (grp, order_id, amount, applied_at) VALUES (?, ?, ?, ?)")
        .bind(group)
        .bind(order)
        .bind(amount)
        .bind(keel_core::clock::utc_now().timestamp_millis())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn ledger_group(group: &'static str) -> Group<Tx> {
    Group::new(TOPIC, group).on_event(move |tx: &mut Tx, ev: ChargeRequested, _env| {
        Box::pin(async move { write_ledger(tx, group, &ev.order, ev.amount).await })
    })
}

async fn ledger(store: &SqliteStore, group: &str) -> Vec<(String, i64)> {
    sqlx::query("SELECT order_id, amount FROM ledger WHERE grp = ? ORDER BY seq")
        .bind(group)
        .fetch_all(store.read_pool())
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn fast_backoff() -> Backoff {
    Backoff::exponential(Duration::from_millis(50), 2.0, Duration::from_millis(500))
        .unwrap()
        .with_jitter(Jitter::None)
        .unwrap()
}

fn consumer<B: Broker + ?Sized>(
    store: &SqliteStore,
    broker: Arc<B>,
) -> ConsumerBuilder<SqliteStore, B> {
    Consumer::builder(store.clone(), broker)
        .backoff(fast_backoff())
        .receive_wait(Duration::from_millis(100))
}

/// A running consumer and the switch that stops it.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<ShutdownReport>,
}

fn start<B: Broker + ?Sized>(consumer: Consumer<SqliteStore, B>) -> Running {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    Running { stop, task }
}

impl Running {
    async fn stop(self) -> ShutdownReport {
        let _ = self.stop.send(());
        self.task.await.unwrap()
    }
}

/// The counter `name` of consumer group `group`.
fn counter(name: &str, group: &str) -> u64 {
    MetricsRecorder::global().sum(name, &format!("group={group}"))
}

// ------------------------------------------------ crash-before-ack broker --

/// A broker whose first `n` acks are lost, as if the consumer died after
/// its commit and before the ack reached the broker.
struct LosesAcks {
    inner: Arc<SqliteBroker>,
    remaining: Arc<AtomicU32>,
}

#[async_trait]
impl Broker for LosesAcks {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.inner.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        Ok(Box::new(LosesAcksSubscription {
            inner: self.inner.subscribe(options).await?,
            remaining: Arc::clone(&self.remaining),
        }))
    }
}

struct LosesAcksSubscription {
    inner: Box<dyn Subscription>,
    remaining: Arc<AtomicU32>,
}

#[async_trait]
impl Subscription for LosesAcksSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let batch = self.inner.receive(max, wait).await?;
        Ok(batch
            .into_iter()
            .map(|d| {
                let (message, count) = (d.message.clone(), d.delivery_count);
                let control = LostAck {
                    inner: d,
                    remaining: Arc::clone(&self.remaining),
                };
                Delivery::new(message, count, Box::new(control))
            })
            .collect())
    }
}

struct LostAck {
    inner: Delivery,
    remaining: Arc<AtomicU32>,
}

#[async_trait]
impl DeliveryControl for LostAck {
    async fn ack(&self) -> Result<(), BrokerError> {
        let lose = self
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            return Err(BrokerError::Unavailable(
                "connection lost before the ack".into(),
            ));
        }
        self.inner.ack().await
    }
    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.inner.nack(delay).await
    }
    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        self.inner.extend_lease(lease).await
    }
    async fn terminate(&self) -> Result<(), BrokerError> {
        self.inner.terminate().await
    }
}

// ---------------------------------------------------------------- tests --

/// Prove duplicates are harmless, because they WILL happen.
/// The same delivery arrives three times (two acks lost after the commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_is_idempotent_under_triple_delivery() {
    let f = fixture().await;
    let group = "billing-triple";
    let broker = Arc::new(LosesAcks {
        inner: Arc::clone(&f.broker),
        remaining: Arc::new(AtomicU32::new(2)),
    });
    broker
        .publish(&[message(&f.store, &charge("A-4471", 8210))])
        .await
        .unwrap();
    let counts = Arc::new(RwLock::new(Vec::new()));
    let seen = Arc::clone(&counts);
    let handler = Group::new(TOPIC, group).on(ChargeRequested::TYPE, Recorded { group, seen });
    let running = start(
        consumer(&f.store, broker)
            .lease(Duration::from_millis(400))
            .group(handler)
            .build()
            .unwrap(),
    );
    eventually("two duplicates", Duration::from_secs(20), || async {
        counter("keel_consumer_duplicates_total", group) >= 2
    })
    .await;
    running.stop().await;
    let total: i64 = ledger(&f.store, group).await.iter().map(|(_, a)| a).sum();
    assert_eq!(total, 8210, "charged ONCE");
    assert_eq!(
        *counts.read().unwrap(),
        [1],
        "the handler ran once, on delivery 1"
    );
}

/// A handler that records the delivery count of each run.
struct Recorded {
    group: &'static str,
    seen: Arc<RwLock<Vec<u32>>>,
}

#[async_trait]
impl keel_messaging::consumer::Handler<Tx> for Recorded {
    async fn handle(
        &self,
        tx: &mut Tx,
        envelope: &Envelope,
        info: &keel_messaging::consumer::DeliveryInfo,
    ) -> Result<(), HandlerError> {
        self.seen.write().unwrap().push(info.delivery_count);
        let ev: ChargeRequested = envelope.data_as()?;
        write_ledger(tx, self.group, &ev.order, ev.amount).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_after_5_deliveries_without_blocking_other_keys() {
    let f = fixture().await;
    let group = "billing-poison";
    let poison = message(&f.store, &charge("POISON", 1));
    let mut batch = vec![poison.clone()];
    batch.extend((0..5).map(|i| message(&f.store, &charge(&format!("B-{i}"), i))));
    f.broker.publish(&batch).await.unwrap();
    let handler = Group::new(TOPIC, group).on_event(move |tx: &mut Tx, ev: ChargeRequested, _| {
        Box::pin(async move {
            if ev.order == "POISON" {
                return Err(HandlerError::retryable(std::io::Error::other(
                    "inventory service unreachable",
                )));
            }
            write_ledger(tx, group, &ev.order, ev.amount).await
        })
    });
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(handler)
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually(
        "the poison message dead-lettered",
        Duration::from_secs(20),
        || {
            let store = store.clone();
            async move { store.dead_letter_counts().await.unwrap().len() == 1 }
        },
    )
    .await;
    running.stop().await;

    let letter = f
        .store
        .dead_letter_list(&DeadLetterFilter::default())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(letter.error_kind, kind::TOO_MANY_ATTEMPTS);
    assert_eq!(letter.message.id, poison.id);
    let attempts: Vec<u32> = letter.attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(
        attempts,
        [1, 2, 3, 4, 5],
        "its full history travels with it"
    );
    assert!(
        letter
            .attempts
            .iter()
            .all(|a| a.error.contains("inventory service unreachable"))
    );
    assert!(letter.attempts.windows(2).all(|w| w[0].at <= w[1].at));

    let applied = ledger(&f.store, group).await;
    assert_eq!(applied.len(), 5, "every other key applied");
    let last_applied: i64 = sqlx::query("SELECT MAX(applied_at) FROM ledger WHERE grp = ?")
        .bind(group)
        .fetch_one(f.store.read_pool())
        .await
        .unwrap()
        .get(0);
    assert!(
        last_applied < letter.dead_at.timestamp_millis(),
        "other keys did not wait for the poison message's retries"
    );
    assert!(
        f.store
            .failure_history(group, &poison.id)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_unknown_type_messages_are_dead_lettered_at_once() {
    let f = fixture().await;
    let group = "billing-bad-input";
    let garbage = Message::new("garbage-1", TOPIC, "k1", &b"\x00\x01 not an event"[..]);
    let mut refund = Envelope::new("/services/orders", "shop.refund.issued.v1");
    refund.subject = Some("k2".into());
    let unknown = message(&f.store, &refund);
    let good = message(&f.store, &charge("k1", 5));
    f.broker
        .publish(&[garbage, unknown.clone(), good])
        .await
        .unwrap();
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group(group))
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually(
        "both bad messages dead-lettered and the good one applied",
        Duration::from_secs(20),
        || {
            let store = store.clone();
            async move {
                store.dead_letter_counts().await.unwrap().len() == 2
                    && ledger(&store, group).await.len() == 1
            }
        },
    )
    .await;
    running.stop().await;
    let letters = f
        .store
        .dead_letter_list(&DeadLetterFilter::default())
        .await
        .unwrap();
    let by_id: HashMap<_, _> = letters.iter().map(|l| (l.message.id.as_str(), l)).collect();
    let malformed = by_id["garbage-1"];
    assert_eq!(malformed.error_kind, kind::MALFORMED);
    assert_eq!(
        malformed.attempts.len(),
        1,
        "dead-lettered on its first delivery"
    );
    assert!(malformed.attempts[0].error.contains("cannot decode"));
    let unknown_letter = by_id[unknown.id.as_str()];
    assert_eq!(unknown_letter.error_kind, kind::UNKNOWN_TYPE);
    assert_eq!(unknown_letter.attempts[0].attempt, 1);
    assert!(
        unknown_letter.attempts[0]
            .error
            .contains("shop.refund.issued.v1")
    );
    assert_eq!(
        ledger(&f.store, group).await,
        [("k1".to_owned(), 5)],
        "k1 not blocked by garbage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_message_is_dropped_and_counted_not_processed() {
    let f = fixture().await;
    let group = "billing-expiry";
    let past = keel_core::clock::unix_millis() - 5_000;
    let future = keel_core::clock::unix_millis() + 600_000;
    let late =
        message(&f.store, &charge("LATE", 1)).with_header(header::DEADLINE, past.to_string());
    let timely =
        message(&f.store, &charge("TIMELY", 2)).with_header(header::DEADLINE, future.to_string());
    f.broker.publish(&[late, timely]).await.unwrap();
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group(group))
            .build()
            .unwrap(),
    );
    eventually(
        "the expired message counted",
        Duration::from_secs(20),
        || async { counter("keel_consumer_expired_total", group) == 1 },
    )
    .await;
    let store = f.store.clone();
    eventually(
        "the timely message applied",
        Duration::from_secs(20),
        || {
            let store = store.clone();
            async move { !ledger(&store, group).await.is_empty() }
        },
    )
    .await;
    running.stop().await;
    assert_eq!(ledger(&f.store, group).await, [("TIMELY".to_owned(), 2)]);
    assert!(
        f.store.dead_letter_counts().await.unwrap().is_empty(),
        "dropped, not dead-lettered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_extension_keeps_a_slow_handlers_message_from_redelivery() {
    let f = fixture().await;
    let group = "billing-slow";
    f.broker
        .publish(&[message(&f.store, &charge("SLOW", 9))])
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let slow = |runs: Arc<AtomicU32>| {
        Group::new(TOPIC, group).on_event(move |tx: &mut Tx, ev: ChargeRequested, _| {
            let runs = Arc::clone(&runs);
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                // Four leases long.
                tokio::time::sleep(Duration::from_millis(2_400)).await;
                write_ledger(tx, group, &ev.order, ev.amount).await
            })
        })
    };
    // Two consumers compete for the message: without the extension the
    // other would receive it when the first lease ran out.
    let [a, b] = [0, 1].map(|_| {
        start(
            consumer(&f.store, f.broker.clone())
                .lease(Duration::from_millis(600))
                .group(slow(Arc::clone(&runs)))
                .build()
                .unwrap(),
        )
    });
    let store = f.store.clone();
    eventually("the slow handler applied", Duration::from_secs(20), || {
        let store = store.clone();
        async move { !ledger(&store, group).await.is_empty() }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.stop().await;
    b.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(ledger(&f.store, group).await, [("SLOW".to_owned(), 9)]);
    assert_eq!(
        counter("keel_consumer_duplicates_total", group),
        0,
        "never redelivered"
    );
}

/// A handler that takes a while after writing its effect.
fn slow_group(group: &'static str) -> Group<Tx> {
    Group::new(TOPIC, group).on_event(move |tx: &mut Tx, ev: ChargeRequested, _| {
        Box::pin(async move {
            write_ledger(tx, group, &ev.order, ev.amount).await?;
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(())
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_loses_nothing() {
    let f = fixture().await;
    let group = "billing-shutdown";
    let n = 40;
    let batch: Vec<_> = (0..n)
        .map(|i| message(&f.store, &charge(&format!("S-{i}"), i)))
        .collect();
    f.broker.publish(&batch).await.unwrap();
    // Stop twice mid-stream, once with a drain timeout too short to finish.
    for drain in [Duration::from_secs(5), Duration::from_millis(1)] {
        let running = start(
            consumer(&f.store, f.broker.clone())
                .max_in_flight(NonZeroUsize::new(4).unwrap())
                .drain_timeout(drain)
                .group(slow_group(group))
                .build()
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let report = running.stop().await;
        let applied = ledger(&f.store, group).await.len();
        assert!(
            applied < n as usize,
            "stopped mid-stream ({applied} applied, {report:?})"
        );
        if drain < Duration::from_millis(10) {
            assert!(
                !report.drained && report.released > 0,
                "handlers were cut off: {report:?}"
            );
        } else {
            assert!(report.drained, "{report:?}");
        }
    }
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(slow_group(group))
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually(
        "every message applied after the restarts",
        Duration::from_secs(30),
        || {
            let store = store.clone();
            async move { ledger(&store, group).await.len() >= n as usize }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    let mut orders: Vec<String> = ledger(&f.store, group)
        .await
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    orders.sort();
    let mut expected: Vec<String> = (0..n).map(|i| format!("S-{i}")).collect();
    expected.sort();
    assert_eq!(orders, expected, "every message applied exactly once");
}

/// Business transaction → outbox → relay → broker → consumer, with several
/// entities updated in turn: every event applied once, in per-entity order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_every_committed_event_is_applied_once_in_per_key_order() {
    let f = fixture().await;
    let group = "billing-e2e";
    let outbox = Outbox::new(f.store.clone());
    let relay = OutboxRelay::builder(&outbox, f.broker.clone())
        .build()
        .unwrap();
    let (relay_stop, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = relay_stopped.await;
            })
            .await;
    });
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group(group))
            .build()
            .unwrap(),
    );
    let keys = ["K-1", "K-2", "K-3", "K-4"];
    let rounds = 10;
    for amount in 0..rounds {
        let mut tx = f.store.begin().await.unwrap();
        for key in keys {
            outbox
                .append(&mut tx, TOPIC, &charge(key, amount))
                .await
                .unwrap();
        }
        outbox.commit(tx).await.unwrap();
    }
    let store = f.store.clone();
    let total = keys.len() * rounds as usize;
    eventually("every event applied", Duration::from_secs(30), || {
        let store = store.clone();
        async move { ledger(&store, group).await.len() >= total }
    })
    .await;
    running.stop().await;
    let _ = relay_stop.send(());
    relay_task.await.unwrap();
    let applied = ledger(&f.store, group).await;
    assert_eq!(applied.len(), total, "exactly once");
    for key in keys {
        let amounts: Vec<i64> = applied
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, a)| *a)
            .collect();
        assert_eq!(
            amounts,
            (0..rounds).collect::<Vec<_>>(),
            "order kept for {key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_each_apply_the_event_once() {
    let f = fixture().await;
    f.broker
        .publish(&[message(&f.store, &charge("A-1", 3))])
        .await
        .unwrap();
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group("billing-two"))
            .group(ledger_group("audit-two"))
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually("both groups applied", Duration::from_secs(20), || {
        let store = store.clone();
        async move {
            ledger(&store, "billing-two").await.len() == 1
                && ledger(&store, "audit-two").await.len() == 1
        }
    })
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_prunes_old_inbox_rows() {
    let f = fixture().await;
    let group = "billing-prune";
    f.broker
        .publish(&[
            message(&f.store, &charge("OLD", 1)),
            message(&f.store, &charge("NEW", 2)),
        ])
        .await
        .unwrap();
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group(group))
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually("both applied", Duration::from_secs(20), || {
        let store = store.clone();
        async move { ledger(&store, group).await.len() == 2 }
    })
    .await;
    running.stop().await;
    // Age one inbox row past the 7-day retention; a restart prunes it.
    sqlx::query(
        "UPDATE keel_inbox SET processed_at = processed_at - ? WHERE event_id IN
           (SELECT event_id FROM keel_inbox WHERE handler = ? ORDER BY processed_at LIMIT 1)",
    )
    .bind(8 * 24 * 3600 * 1000_i64)
    .bind(group)
    .execute(f.store.pool())
    .await
    .unwrap();
    let running = start(
        consumer(&f.store, f.broker.clone())
            .group(ledger_group(group))
            .build()
            .unwrap(),
    );
    let store = f.store.clone();
    eventually("the old row pruned", Duration::from_secs(20), || {
        let store = store.clone();
        async move {
            let n: i64 = sqlx::query("SELECT COUNT(*) FROM keel_inbox WHERE handler = ?")
                .bind(group)
                .fetch_one(store.read_pool())
                .await
                .unwrap()
                .get(0);
            n == 1
        }
    })
    .await;
    running.stop().await;
}

/// The trace a handler ran in, and the `tracestate` it saw.
type SeenTrace = (keel_core::TraceParent, Option<String>);

/// What a handler saw of the trace it ran in.
struct TraceSeen {
    seen: Arc<RwLock<Vec<SeenTrace>>>,
}

#[async_trait]
impl keel_messaging::consumer::Handler<Tx> for TraceSeen {
    async fn handle(
        &self,
        _tx: &mut Tx,
        _envelope: &Envelope,
        _info: &keel_messaging::consumer::DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let trace = keel_core::TraceParent::current().expect("a trace for every delivery");
        let state = keel_core::trace::TraceState::current().map(|s| s.to_string());
        self.seen.write().unwrap().push((trace, state));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_links_to_the_producers_trace_and_keeps_its_tracestate() {
    let f = fixture().await;
    let group = "tracing";
    let producer: keel_core::TraceParent =
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap();
    let vendors = keel_core::trace::TraceState::from_values(["rojo=00f067aa0ba902b7"])
        .unwrap()
        .unwrap();
    // The event is appended inside the producer's request: it takes the
    // request's trace context, and the relay carries it as headers.
    let env = producer
        .scope(vendors.scope(async { charge("A-4471", 100) }))
        .await;
    let outbox = Outbox::new(f.store.clone());
    let mut tx = f.store.begin().await.unwrap();
    outbox.append(&mut tx, TOPIC, &env).await.unwrap();
    outbox.commit(tx).await.unwrap();
    let relay = OutboxRelay::builder(&outbox, Arc::clone(&f.broker))
        .build()
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1);

    let seen = Arc::new(RwLock::new(Vec::new()));
    let handler = Group::new(TOPIC, group).on(
        ChargeRequested::TYPE,
        TraceSeen {
            seen: Arc::clone(&seen),
        },
    );
    let running = start(
        consumer(&f.store, Arc::clone(&f.broker))
            .group(handler)
            .build()
            .unwrap(),
    );
    eventually("the delivery", Duration::from_secs(20), || async {
        !seen.read().unwrap().is_empty()
    })
    .await;
    running.stop().await;
    let (trace, state) = seen.read().unwrap()[0].clone();
    assert_ne!(
        trace.trace_id(),
        producer.trace_id(),
        "the handler's trace is its own: linked to the producer, not nested"
    );
    assert!(trace.sampled(), "the producer's sampling decision holds");
    assert_eq!(
        state.as_deref(),
        Some("rojo=00f067aa0ba902b7"),
        "tracestate crossed the broker"
    );
}
