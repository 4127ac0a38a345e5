//! The outbox and its relay on the real embedded backends, crashes included.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use keel_messaging::broker::{
    Broker, BrokerError, Message, SubscribeOptions, Subscription, header,
};
use keel_messaging::consumer::{Consumer, Group};
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxError, OutboxRelay, RelayError};
use keel_messaging::store::{OutboxAdminStore, OutboxStore, Store};
use keel_sqlite::broker::{SqliteBroker, SqliteBrokerOptions};
use keel_sqlite::store::SqliteStore;
use keel_testkit::eventually;
use serde::{Deserialize, Serialize};
use sqlx::Row;
use tempfile::TempDir;

type Tx = <SqliteStore as Store>::Tx;

const TOPIC: &str = "orders";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_minor: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

/// What the broker saw: publish calls per event id, and whether a publish
/// should "crash" (never return) after reaching the broker.
#[derive(Default)]
struct Tap {
    calls: RwLock<HashMap<String, u32>>,
    hang_after_publish: AtomicU32,
    fail_publishes: AtomicU32,
    published: tokio::sync::Notify,
}

/// The real broker behind a tap. With `fresh_ids`, every publish call gets
/// its own message ids, like a broker without publisher dedupe (or one whose
/// dedupe window has passed), so consumers see every republish.
struct TappedBroker {
    inner: Arc<SqliteBroker>,
    tap: Arc<Tap>,
    fresh_ids: bool,
}

#[async_trait]
impl Broker for TappedBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        if take_one(&self.tap.fail_publishes) {
            return Err(BrokerError::Unavailable("broker restarting".into()));
        }
        let mut sent = Vec::with_capacity(messages.len());
        for m in messages {
            let event_id = m.header(header::EVENT_ID).unwrap_or(&m.id).to_owned();
            let n = {
                let mut calls = self.tap.calls.write().unwrap();
                let n = calls.entry(event_id).or_default();
                *n += 1;
                *n
            };
            let mut m = m.clone();
            if self.fresh_ids {
                m.id = format!("{}#{n}", m.id);
            }
            sent.push(m);
        }
        self.inner.publish(&sent).await?;
        self.tap.published.notify_one();
        if take_one(&self.tap.hang_after_publish) {
            // The process dies here: after the broker has the messages,
            // before the relay marks them published.
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.inner.subscribe(options).await
    }
}

fn take_one(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

struct Fixture {
    _dir: TempDir,
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
    outbox: Outbox<SqliteStore>,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    for ddl in [
        "CREATE TABLE orders (id TEXT PRIMARY KEY, total_minor INTEGER NOT NULL)",
        "CREATE TABLE charges (seq INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL,
                               total_minor INTEGER NOT NULL)",
    ] {
        sqlx::query(ddl).execute(store.pool()).await.unwrap();
    }
    let broker = Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .unwrap(),
    );
    let outbox = Outbox::new(store.clone());
    Fixture {
        _dir: dir,
        store,
        broker,
        outbox,
    }
}

impl Fixture {
    fn tapped(&self, fresh_ids: bool) -> (Arc<TappedBroker>, Arc<Tap>) {
        let tap = Arc::new(Tap::default());
        let broker = Arc::new(TappedBroker {
            inner: Arc::clone(&self.broker),
            tap: Arc::clone(&tap),
            fresh_ids,
        });
        (broker, tap)
    }

    /// The business transaction: the order row and its event, together.
    async fn place_order(&self, id: &str, total: i64) -> Envelope {
        let mut tx = self.store.begin().await.unwrap();
        let env = self.order_in(&mut tx, id, total).await;
        self.outbox.commit(tx).await.unwrap();
        env
    }

    async fn order_in(&self, tx: &mut Tx, id: &str, total: i64) -> Envelope {
        sqlx::query("INSERT INTO orders (id, total_minor) VALUES (?, ?)")
            .bind(id)
            .bind(total)
            .execute(&mut **tx)
            .await
            .unwrap();
        let placed = OrderPlaced {
            order_id: id.into(),
            total_minor: total,
        };
        self.outbox
            .append_event(tx, TOPIC, "/services/orders", &placed, EventMeta::new(1))
            .await
            .unwrap()
    }

    async fn unpublished(&self) -> u64 {
        self.store.outbox_stats().await.unwrap().unpublished
    }

    async fn charges(&self) -> Vec<(String, i64)> {
        sqlx::query("SELECT order_id, total_minor FROM charges ORDER BY seq")
            .fetch_all(self.store.read_pool())
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
}

/// Every message `group` can receive on the topic now, acked, in order.
async fn drain_topic(broker: &SqliteBroker, group: &str) -> Vec<Message> {
    let mut sub = broker
        .subscribe(SubscribeOptions::new(TOPIC, group))
        .await
        .unwrap();
    let mut out = Vec::new();
    loop {
        let batch = sub.receive(100, Duration::from_millis(200)).await.unwrap();
        if batch.is_empty() {
            return out;
        }
        for d in batch {
            d.ack().await.unwrap();
            out.push(d.message);
        }
    }
}

fn charge_group() -> Group<Tx> {
    Group::new(TOPIC, "billing").on_event(|tx: &mut Tx, ev: OrderPlaced, _env| {
        Box::pin(async move {
            sqlx::query("INSERT INTO charges (order_id, total_minor) VALUES (?, ?)")
                .bind(ev.order_id)
                .bind(ev.total_minor)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    })
}

/// The classic outbox test, with a real crash: the relay dies after the broker
/// accepted the batch and before it marked the rows published. The restarted
/// relay republishes (at-least-once) and the consumer still applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_republishes_after_a_relay_crash_and_the_consumer_applies_once() {
    let f = fixture().await;
    let order = f.place_order("A-4471", 8210).await;
    let (broker, tap) = f.tapped(true);
    let lease = Duration::from_millis(500);

    tap.hang_after_publish.store(1, Ordering::SeqCst);
    let crashing = OutboxRelay::builder(&f.outbox, Arc::clone(&broker))
        .name("relay-1")
        .lease(lease)
        .build()
        .unwrap();
    let task = tokio::spawn(async move { crashing.run_once().await });
    tap.published.notified().await;
    task.abort(); // kill -9, between publish and mark
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(f.unpublished().await, 1, "published but never marked");

    let restarted = OutboxRelay::builder(&f.outbox, Arc::clone(&broker))
        .name("relay-2")
        .lease(lease)
        .build()
        .unwrap();
    assert_eq!(
        restarted.run_once().await.unwrap(),
        0,
        "the dead relay's lease holds"
    );
    tokio::time::sleep(lease).await;
    assert_eq!(
        restarted.run_once().await.unwrap(),
        1,
        "republished after the lease"
    );
    assert_eq!(f.unpublished().await, 0);
    assert_eq!(tap.calls.read().unwrap()[&order.id], 2, "at-least-once");

    let consumer = Consumer::builder(f.store.clone(), Arc::clone(&f.broker))
        .receive_wait(Duration::from_millis(100))
        .group(charge_group())
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    // Both copies reach the consumer (fresh ids defeat the broker's dedupe):
    // the second must be a no-op.
    eventually("the charge applied", Duration::from_secs(20), || async {
        !f.charges().await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop.send(());
    running.await.unwrap();
    assert!(
        drain_topic(&f.broker, "billing").await.is_empty(),
        "the consumer took both copies"
    );
    assert_eq!(
        f.charges().await,
        [("A-4471".to_owned(), 8210)],
        "applied once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_business_transaction_is_never_published() {
    let f = fixture().await;
    let mut tx = f.store.begin().await.unwrap();
    f.order_in(&mut tx, "ROLLED-BACK", 1).await;
    f.store.rollback(tx).await.unwrap();
    let mut tx = f.store.begin().await.unwrap();
    f.order_in(&mut tx, "DROPPED", 2).await;
    drop(tx); // an error path that never commits
    let kept = f.place_order("KEPT", 3).await;

    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
        .build()
        .unwrap();
    while relay.run_once().await.unwrap() > 0 {}
    let published = drain_topic(&f.broker, "audit").await;
    let ids: Vec<_> = published.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [kept.id.as_str()], "only the committed event left");
    let orders: i64 = sqlx::query("SELECT COUNT(*) FROM orders")
        .fetch_one(f.store.read_pool())
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 1, "the business rows rolled back with their events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_message_carries_event_id_key_type_and_trace() {
    let f = fixture().await;
    let root = keel_core::TraceParent::new_root();
    let env = root.scope(f.place_order("A-1", 10)).await;
    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
        .build()
        .unwrap();
    relay.run_once().await.unwrap();
    let msg = drain_topic(&f.broker, "inspect").await.remove(0);
    assert_eq!(msg.id, env.id);
    assert_eq!(msg.key, "A-1");
    assert_eq!(msg.header(header::EVENT_ID), Some(env.id.as_str()));
    assert_eq!(msg.header(header::EVENT_TYPE), Some(OrderPlaced::TYPE));
    let tp: keel_core::TraceParent = msg.header(header::TRACEPARENT).unwrap().parse().unwrap();
    assert_eq!(
        tp.trace_id(),
        root.trace_id(),
        "the trace crosses the broker"
    );
    let sent = Envelope::from_json(&msg.payload).unwrap();
    assert_eq!(sent.trace_parent(), Some(tp), "the producer span's context");
    assert_eq!(
        Envelope {
            traceparent: env.traceparent.clone(),
            ..sent
        },
        env
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_behind_a_dead_relays_claim_are_not_skipped_and_keep_key_order() {
    let f = fixture().await;
    let a1 = f.place_order("A", 1).await;
    let b1 = f.place_order("B", 1).await;
    let mut tx = f.store.begin().await.unwrap();
    let placed = OrderPlaced {
        order_id: "A".into(),
        total_minor: 2,
    };
    let a2 = f
        .outbox
        .append_event(
            &mut tx,
            TOPIC,
            "/services/orders",
            &placed,
            EventMeta::new(2),
        )
        .await
        .unwrap();
    f.outbox.commit(tx).await.unwrap();

    let lease = Duration::from_millis(500);
    let held = f.store.outbox_claim("dead-relay", 1, lease).await.unwrap();
    assert_eq!(held[0].record.event_id, a1.id);
    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
        .lease(lease)
        .build()
        .unwrap();
    assert_eq!(
        relay.run_once().await.unwrap(),
        1,
        "B goes ahead; A's second waits for its first"
    );
    tokio::time::sleep(lease).await;
    while relay.run_once().await.unwrap() > 0 {}
    let order: Vec<_> = drain_topic(&f.broker, "audit")
        .await
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(order, [b1.id, a1.id, a2.id]);
}

/// An order with a note: a way to make one event too large for the broker.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderNoted {
    order_id: String,
    note: String,
}

impl Event for OrderNoted {
    const TYPE: &'static str = "shop.order.noted.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

/// The broker's limit in the poison-row tests: a normal event fits, a
/// 64 KiB note does not.
const SMALL_BROKER_LIMIT: usize = 16 * 1024;

async fn note_in(outbox: &Outbox<SqliteStore>, tx: &mut Tx, order: &str, note: String) -> Envelope {
    let noted = OrderNoted {
        order_id: order.into(),
        note,
    };
    outbox
        .append_event(tx, TOPIC, "/services/orders", &noted, EventMeta::new(1))
        .await
        .unwrap()
}

/// Issue 11 on the real embedded broker: one event the broker refuses for
/// good (over its size limit) sits in the middle of 20 good ones and
/// before a later event of its own key. The broker finds out only when it
/// publishes (the tap does not forward `validate`), so the relay has to
/// find the row by publishing row by row. Every good event is published,
/// the poison row is parked after one attempt, its key's later event waits
/// behind it, nothing is retried in a loop, and discarding it frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_poison_row_is_parked_and_every_other_row_is_published() {
    let f = fixture().await;
    let small = Arc::new(
        SqliteBrokerOptions::new()
            .max_message_bytes(SMALL_BROKER_LIMIT)
            .open(f._dir.path().join("small-broker.db"))
            .await
            .unwrap(),
    );
    let tap = Arc::new(Tap::default());
    let broker = Arc::new(TappedBroker {
        inner: Arc::clone(&small),
        tap: Arc::clone(&tap),
        fresh_ids: false,
    });
    let mut good = Vec::new();
    for i in 0..10 {
        good.push(f.place_order(&format!("A-{i}"), i).await.id);
    }
    let mut tx = f.store.begin().await.unwrap();
    let poison = note_in(&f.outbox, &mut tx, "P-1", "x".repeat(64 * 1024)).await;
    f.outbox.commit(tx).await.unwrap();
    let mut tx = f.store.begin().await.unwrap();
    let behind = note_in(&f.outbox, &mut tx, "P-1", "small".into()).await;
    f.outbox.commit(tx).await.unwrap();
    for i in 10..20 {
        good.push(f.place_order(&format!("A-{i}"), i).await.id);
    }

    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&broker))
        .build()
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 20, "all 20 good events");
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap(), 0, "nothing retried");
    }
    let poison_calls = tap.calls.read().unwrap().get(&poison.id).copied();
    assert_eq!(
        poison_calls,
        Some(2),
        "refused in the batch and once alone, then never again"
    );
    assert_eq!(
        tap.calls.read().unwrap().get(&behind.id).copied(),
        Some(1),
        "the later event of its key went only in the refused batch, never alone"
    );

    let published: Vec<_> = drain_topic(&small, "audit")
        .await
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(published, good, "every good event, once, in order");
    let stats = f.store.outbox_stats().await.unwrap();
    assert_eq!(stats.parked, 1);
    assert_eq!(stats.unpublished, 1, "only its own key waits behind it");
    let parked = f.store.outbox_parked(&Default::default()).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].record.event_id, poison.id);
    assert_eq!(parked[0].attempts, 1);
    assert_eq!(parked[0].held_back, 1);
    assert!(
        parked[0].last_error.contains("claim check"),
        "{}",
        parked[0].last_error
    );

    assert!(f.store.outbox_discard(parked[0].id).await.unwrap());
    assert_eq!(relay.run_once().await.unwrap(), 1);
    let rest: Vec<_> = drain_topic(&small, "audit")
        .await
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(rest, [behind.id], "the key flows again");
}

/// With the broker's rules, `Outbox::append` refuses an event the broker
/// could never take, with a typed error, and writes nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_refuses_an_event_over_the_brokers_limit() {
    let f = fixture().await;
    let small = Arc::new(
        SqliteBrokerOptions::new()
            .max_message_bytes(SMALL_BROKER_LIMIT)
            .open(f._dir.path().join("small-broker.db"))
            .await
            .unwrap(),
    );
    let outbox = Outbox::new(f.store.clone()).with_broker(small);
    let mut tx = f.store.begin().await.unwrap();
    let noted = OrderNoted {
        order_id: "P-1".into(),
        note: "x".repeat(64 * 1024),
    };
    let err = outbox
        .append_event(
            &mut tx,
            TOPIC,
            "/services/orders",
            &noted,
            EventMeta::new(1),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            OutboxError::Unpublishable { key, reason: BrokerError::Invalid(_), .. } if key == "P-1"
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("claim check"), "{err}");
    outbox.commit(tx).await.unwrap();
    assert_eq!(f.unpublished().await, 0, "nothing was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_failure_releases_the_claim_for_the_next_round() {
    let f = fixture().await;
    let env = f.place_order("A", 1).await;
    let (broker, tap) = f.tapped(false);
    tap.fail_publishes.store(1, Ordering::SeqCst);
    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&broker))
        .name("relay-1")
        .build()
        .unwrap();
    assert!(matches!(relay.run_once().await, Err(RelayError::Broker(_))));
    let other = OutboxRelay::builder(&f.outbox, broker)
        .name("relay-2")
        .build()
        .unwrap();
    assert_eq!(
        other.run_once().await.unwrap(),
        1,
        "no need to wait out the lease"
    );
    assert_eq!(drain_topic(&f.broker, "audit").await[0].id, env.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_publish_every_row_once_in_per_key_order() {
    let f = fixture().await;
    let (broker, tap) = f.tapped(false);
    let mut relays = Vec::new();
    let (stop, _) = tokio::sync::watch::channel(false);
    for name in ["relay-a", "relay-b"] {
        let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&broker))
            .name(name)
            .batch_size(NonZeroUsize::new(7).unwrap())
            .poll_interval(Duration::from_millis(20))
            .build()
            .unwrap();
        let mut stopped = stop.subscribe();
        relays.push(tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        }));
    }
    let keys = ["K1", "K2", "K3"];
    for round in 0..20 {
        let mut tx = f.store.begin().await.unwrap();
        for key in keys {
            let placed = OrderPlaced {
                order_id: key.into(),
                total_minor: round,
            };
            f.outbox
                .append_event(&mut tx, TOPIC, "/s", &placed, EventMeta::new(round as u64))
                .await
                .unwrap();
        }
        f.outbox.commit(tx).await.unwrap();
    }
    eventually("everything published", Duration::from_secs(20), || async {
        f.unpublished().await == 0
    })
    .await;
    let _ = stop.send(true);
    for r in relays {
        r.await.unwrap();
    }
    assert!(
        tap.calls.read().unwrap().values().all(|n| *n == 1),
        "no row published twice while the claims held"
    );
    let log = drain_topic(&f.broker, "audit").await;
    assert_eq!(log.len(), 60);
    for key in keys {
        let versions: Vec<u64> = log
            .iter()
            .filter(|m| m.key == key)
            .map(|m| Envelope::from_json(&m.payload).unwrap().version().unwrap())
            .collect();
        assert_eq!(versions, (0..20).collect::<Vec<_>>(), "order of {key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_old_published_rows_in_bounded_batches() {
    let f = fixture().await;
    for i in 0..5 {
        f.place_order(&format!("P-{i}"), i).await;
    }
    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
        .prune_batch(NonZeroUsize::new(2).unwrap())
        .build()
        .unwrap();
    relay.run_once().await.unwrap();
    f.place_order("UNPUBLISHED", 9).await;
    assert_eq!(
        relay.prune_once().await.unwrap(),
        0,
        "younger than the 7-day retention"
    );
    let eight_days_ms = 8 * 24 * 3600 * 1000_i64;
    sqlx::query(
        "UPDATE keel_outbox SET published_at = published_at - ? WHERE published_at IS NOT NULL",
    )
    .bind(eight_days_ms)
    .execute(f.store.pool())
    .await
    .unwrap();
    assert_eq!(relay.prune_once().await.unwrap(), 5);
    let left: i64 = sqlx::query("SELECT COUNT(*) FROM keel_outbox")
        .fetch_one(f.store.read_pool())
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1, "the unpublished row is never pruned");
    assert_eq!(f.unpublished().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archiving_relay_moves_old_published_rows_to_the_archive() {
    let f = fixture().await;
    for i in 0..3 {
        f.place_order(&format!("A-{i}"), i).await;
    }
    let relay = OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
        .retention(Duration::from_secs(60))
        .archive(true)
        .build()
        .unwrap();
    relay.run_once().await.unwrap();
    sqlx::query(
        "UPDATE keel_outbox SET published_at = published_at - 120000 WHERE published_at IS NOT NULL",
    )
    .execute(f.store.pool())
    .await
    .unwrap();
    assert_eq!(relay.prune_once().await.unwrap(), 3);
    assert_eq!(f.store.outbox_published(0, 10).await.unwrap(), []);
    let archived = f.store.outbox_archived(0, 10).await.unwrap();
    assert_eq!(archived.len(), 3, "kept for the audit: {archived:?}");
    let payloads: i64 =
        sqlx::query("SELECT COUNT(*) FROM keel_outbox_archive WHERE length(payload) > 0")
            .fetch_one(f.store.read_pool())
            .await
            .unwrap()
            .get(0);
    assert_eq!(payloads, 3, "with their payloads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_relays_under_one_lease_only_the_holder_prunes() {
    use keel_messaging::lease::{LeaseGate, LeaseLock};
    let f = fixture().await;
    for i in 0..3 {
        f.place_order(&format!("L-{i}"), i).await;
    }
    let relay = |holder: &str| {
        let lock = LeaseLock::new(
            f.store.clone(),
            "outbox-prune",
            holder,
            Duration::from_secs(60),
        );
        OutboxRelay::builder(&f.outbox, Arc::clone(&f.broker))
            .retention(Duration::from_secs(60))
            .prune_under(LeaseGate::new(lock))
            .build()
            .unwrap()
    };
    let (a, b) = (relay("relay-a"), relay("relay-b"));
    a.run_once().await.unwrap();
    sqlx::query(
        "UPDATE keel_outbox SET published_at = published_at - 120000 WHERE published_at IS NOT NULL",
    )
    .execute(f.store.pool())
    .await
    .unwrap();
    // relay-a's prune takes the lease; relay-b's finds it held and skips.
    f.place_order("L-late", 9).await;
    b.run_once().await.unwrap();
    assert_eq!(a.prune_once().await.unwrap(), 3);
    sqlx::query(
        "UPDATE keel_outbox SET published_at = published_at - 120000 WHERE published_at IS NOT NULL",
    )
    .execute(f.store.pool())
    .await
    .unwrap();
    assert_eq!(b.prune_once().await.unwrap(), 0, "not the lease holder");
    assert_eq!(a.prune_once().await.unwrap(), 1, "the holder goes on");
}
