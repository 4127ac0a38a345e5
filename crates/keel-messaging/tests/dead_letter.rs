//! Dead-letter operations on the real embedded backends: list, inspect,
//! count, discard, and replay through the outbox, applied once and in order.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_messaging::broker::{Broker, header};
use keel_messaging::consumer::{Backoff, Consumer, Group, HandlerError, Jitter};
use keel_messaging::dead_letter::{DeadLetterError, DeadLetters, REPLAY_GROUP_HEADER, kind};
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::{DeadLetterFilter, DeadLetterStatus, OutboxStore, Store};
use keel_sqlite::broker::SqliteBroker;
use keel_sqlite::store::SqliteStore;
use keel_testkit::eventually;
use serde::{Deserialize, Serialize};
use sqlx::Row;
use tempfile::TempDir;

type Tx = <SqliteStore as Store>::Tx;

const TOPIC: &str = "stock";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StockReserved {
    sku: String,
    qty: i64,
}

impl Event for StockReserved {
    const TYPE: &'static str = "shop.stock.reserved.v1";
    fn subject(&self) -> String {
        self.sku.clone()
    }
}

struct Fixture {
    _dir: TempDir,
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
    outbox: Outbox<SqliteStore>,
    letters: DeadLetters<SqliteStore>,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    sqlx::query(
        "CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, grp TEXT NOT NULL,
                               sku TEXT NOT NULL, qty INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let broker = Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .unwrap(),
    );
    let outbox = Outbox::new(store.clone());
    let letters = DeadLetters::with_outbox(outbox.clone());
    Fixture {
        _dir: dir,
        store,
        broker,
        outbox,
        letters,
    }
}

impl Fixture {
    /// Commits events for `(sku, qty)` pairs through the outbox, in order.
    async fn emit(&self, events: &[(&str, i64)]) -> Vec<Envelope> {
        let mut tx = self.store.begin().await.unwrap();
        let mut out = Vec::new();
        for (i, (sku, qty)) in events.iter().enumerate() {
            let event = StockReserved {
                sku: (*sku).into(),
                qty: *qty,
            };
            let env = self
                .outbox
                .append_event(
                    &mut tx,
                    TOPIC,
                    "/services/stock",
                    &event,
                    EventMeta::new(i as u64),
                )
                .await
                .unwrap();
            out.push(env);
        }
        self.outbox.commit(tx).await.unwrap();
        out
    }

    async fn relay_all(&self) {
        let relay = OutboxRelay::builder(&self.outbox, Arc::clone(&self.broker))
            .build()
            .unwrap();
        while relay.run_once().await.unwrap() > 0 {}
    }

    async fn effects(&self, group: &str) -> Vec<(String, i64)> {
        sqlx::query("SELECT sku, qty FROM effects WHERE grp = ? ORDER BY seq")
            .bind(group)
            .fetch_all(self.store.read_pool())
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    async fn pending(&self) -> u64 {
        self.letters
            .counts()
            .await
            .unwrap()
            .iter()
            .map(|(_, n)| n)
            .sum()
    }

    /// Runs a consumer with `groups` until `done` holds, then stops it.
    async fn consume_until<F, Fut>(&self, groups: Vec<Group<Tx>>, done: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let backoff =
            Backoff::exponential(Duration::from_millis(20), 2.0, Duration::from_millis(200))
                .unwrap()
                .with_jitter(Jitter::None)
                .unwrap();
        let mut builder = Consumer::builder(self.store.clone(), Arc::clone(&self.broker))
            .backoff(backoff)
            .receive_wait(Duration::from_millis(100));
        for g in groups {
            builder = builder.group(g);
        }
        let consumer = builder.build().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        eventually("the condition", Duration::from_secs(20), done).await;
        // Time for stray duplicates to show up if there were any.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = stop.send(());
        running.await.unwrap();
    }
}

/// Applies every reservation, or refuses the skus in `broken` permanently.
fn reserve(group: &'static str, broken: &'static [&'static str]) -> Group<Tx> {
    Group::new(TOPIC, group).on_event(move |tx: &mut Tx, ev: StockReserved, _env| {
        Box::pin(async move {
            if broken.contains(&ev.sku.as_str()) {
                return Err(HandlerError::permanent(format!(
                    "no warehouse stocks {}",
                    ev.sku
                )));
            }
            sqlx::query("INSERT INTO effects (grp, sku, qty) VALUES (?, ?, ?)")
                .bind(group)
                .bind(ev.sku)
                .bind(ev.qty)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    })
}

/// A group that knows nothing of stock events (its handler is not deployed).
fn not_deployed(group: &'static str) -> Group<Tx> {
    Group::new(TOPIC, group).on_fn("shop.other.thing.v1", |_tx: &mut Tx, _env| {
        Box::pin(async { Ok(()) })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_the_dead_letter_store_is_durable_and_applied_once() {
    let f = fixture().await;
    let env = f.emit(&[("SKU-1", 2)]).await.remove(0);
    f.relay_all().await;
    // `picking` has not deployed its handler yet; `audit` applies the event.
    f.consume_until(
        vec![not_deployed("picking"), reserve("audit", &[])],
        || async { f.pending().await == 1 && f.effects("audit").await.len() == 1 },
    )
    .await;
    let letter = f
        .letters
        .list(&DeadLetterFilter::default())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(letter.error_kind, kind::UNKNOWN_TYPE);
    assert_eq!(letter.group, "picking");

    // The replay and the settle commit together, before anything is sent.
    f.letters.replay(&letter.id).await.unwrap();
    let settled = f.letters.inspect(&letter.id).await.unwrap().unwrap();
    assert_eq!(settled.status, DeadLetterStatus::Replayed);
    assert_eq!(
        f.store.outbox_stats().await.unwrap().unpublished,
        1,
        "queued in the outbox"
    );
    assert!(matches!(
        f.letters.replay(&letter.id).await,
        Err(DeadLetterError::NotPending { .. })
    ));

    f.relay_all().await;
    f.consume_until(
        vec![reserve("picking", &[]), reserve("audit", &[])],
        || async { f.effects("picking").await.len() == 1 },
    )
    .await;
    assert_eq!(
        f.effects("picking").await,
        [("SKU-1".to_owned(), 2)],
        "applied once"
    );
    assert_eq!(
        f.effects("audit").await.len(),
        1,
        "the other group did not apply it again"
    );

    // The replayed message: a fresh message id, the original event id.
    let mut sub = f
        .broker
        .subscribe(keel_messaging::broker::SubscribeOptions::new(
            TOPIC,
            "inspector",
        ))
        .await
        .unwrap();
    let mut log = Vec::new();
    loop {
        // Same key: the second is delivered once the first is acked.
        let batch = sub.receive(10, Duration::from_millis(500)).await.unwrap();
        if batch.is_empty() {
            break;
        }
        for d in batch {
            d.ack().await.unwrap();
            log.push(d.message);
        }
    }
    assert_eq!(log.len(), 2);
    let replayed = &log[1];
    assert_ne!(replayed.id, env.id);
    assert_eq!(replayed.header(header::EVENT_ID), Some(env.id.as_str()));
    assert_eq!(replayed.header(REPLAY_GROUP_HEADER), Some("picking"));
    assert_eq!(replayed.payload, log[0].payload);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_many_keeps_each_keys_order() {
    let f = fixture().await;
    f.emit(&[("K", 1), ("J", 1), ("K", 2), ("K", 3), ("OK", 1)])
        .await;
    f.relay_all().await;
    // A bug rejects K and J: all their events are dead-lettered, in order.
    f.consume_until(vec![reserve("picking", &["K", "J"])], || async {
        f.pending().await == 4 && f.effects("picking").await.len() == 1
    })
    .await;
    let counts = f.letters.counts().await.unwrap();
    assert_eq!(counts, [(kind::PERMANENT.to_owned(), 4)]);

    // Fixed: replay them all.
    let filter = DeadLetterFilter {
        topic: Some(TOPIC.into()),
        ..Default::default()
    };
    assert_eq!(f.letters.replay_many(&filter).await.unwrap(), 4);
    assert_eq!(
        f.letters.replay_many(&filter).await.unwrap(),
        0,
        "nothing left pending"
    );
    f.relay_all().await;
    f.consume_until(vec![reserve("picking", &[])], || async {
        f.effects("picking").await.len() == 5
    })
    .await;
    let effects = f.effects("picking").await;
    let k: Vec<i64> = effects
        .iter()
        .filter(|(s, _)| s == "K")
        .map(|(_, q)| *q)
        .collect();
    assert_eq!(k, [1, 2, 3], "K's events in their original order");
    assert_eq!(effects.iter().filter(|(s, _)| s == "J").count(), 1);
    assert_eq!(f.pending().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_inspect_count_and_discard() {
    let f = fixture().await;
    f.emit(&[("BAD-1", 1), ("BAD-2", 1)]).await;
    f.relay_all().await;
    let garbage = keel_messaging::broker::Message::new("garbage", TOPIC, "X", &b"%%%"[..]);
    f.broker.publish(&[garbage]).await.unwrap();
    f.consume_until(vec![reserve("picking", &["BAD-1", "BAD-2"])], || async {
        f.pending().await == 3
    })
    .await;

    let counts = f.letters.counts().await.unwrap();
    assert_eq!(
        counts,
        [
            (kind::PERMANENT.to_owned(), 2),
            (kind::MALFORMED.to_owned(), 1)
        ],
        "grouped by kind, most frequent first"
    );
    let permanent = f
        .letters
        .list(&DeadLetterFilter {
            error_kind: Some(kind::PERMANENT.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(permanent.len(), 2);
    let one = f.letters.inspect(&permanent[0].id).await.unwrap().unwrap();
    assert_eq!(one.attempts.len(), 1);
    assert!(one.attempts[0].error.contains("no warehouse stocks"));

    f.letters.discard(&one.id).await.unwrap();
    assert!(matches!(
        f.letters.discard(&one.id).await,
        Err(DeadLetterError::NotPending {
            status: DeadLetterStatus::Discarded,
            ..
        })
    ));
    assert!(matches!(
        f.letters.replay(&one.id).await,
        Err(DeadLetterError::NotPending { .. })
    ));
    assert!(matches!(
        f.letters.replay("no-such-letter").await,
        Err(DeadLetterError::NotFound(_))
    ));
    assert_eq!(f.pending().await, 2);
    let discarded = f
        .letters
        .list(&DeadLetterFilter {
            status: Some(DeadLetterStatus::Discarded),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(discarded.len(), 1);
    assert_eq!(
        f.store.outbox_stats().await.unwrap().unpublished,
        0,
        "discard sends nothing"
    );
}
