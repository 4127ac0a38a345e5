//! Faults against the real server, judged by keel-testkit's ledger: a
//! PostgreSQL restart in the middle of appends + relay + consumer, and a
//! relay replica killed in the middle of a batch while another runs. In
//! both, nothing committed is lost and no effect happens twice.

#[path = "../../keel-postgres/tests/common/mod.rs"]
mod common;
#[path = "postgres/recording_broker.rs"]
mod recording_broker;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_messaging::broker::Broker;
use keel_messaging::consumer::{Consumer, Group};
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::Store;
use keel_postgres::PgStore;
use keel_sqlite::broker::SqliteBroker;
use keel_testkit::ledger::Ledger;
use keel_testkit::services::{self, Service};
use serde::{Deserialize, Serialize};
use tempfile::TempDir;

use recording_broker::{Recorded, RecordingBroker};

type Tx = <PgStore as Store>::Tx;

const TOPIC: &str = "orders";
const BILLING: &str = "billing";
const KEYS: usize = 8;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderChanged {
    order_id: String,
}

impl Event for OrderChanged {
    const TYPE: &'static str = "shop.order.changed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

struct World {
    store: PgStore,
    outbox: Outbox<PgStore>,
    broker: Arc<SqliteBroker>,
    recorded: Arc<Recorded>,
    ledger: Ledger,
    _dir: TempDir,
}

async fn world(store: PgStore) -> World {
    sqlx::query(
        "CREATE TABLE effects (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                               grp TEXT NOT NULL, event_id TEXT NOT NULL,
                               order_id TEXT NOT NULL, version BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await
    .expect("effects table");
    let dir = tempfile::tempdir().expect("temp dir");
    let broker = Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .expect("broker"),
    );
    World {
        outbox: Outbox::new(store.clone()),
        store,
        broker,
        recorded: Arc::new(Recorded::default()),
        ledger: Ledger::with_handlers([BILLING]),
        _dir: dir,
    }
}

impl World {
    fn recording_broker(&self) -> RecordingBroker {
        let inner: Arc<dyn Broker> = self.broker.clone();
        RecordingBroker::new(Arc::clone(&self.recorded), Some(inner)).with_fresh_ids()
    }

    fn spawn_consumer(&self) -> tokio::task::JoinHandle<()> {
        let group = Group::new(TOPIC, BILLING).on_event(|tx: &mut Tx, _: OrderChanged, env| {
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO effects (grp, event_id, order_id, version) VALUES ($1, $2, $3, $4)",
                )
                .bind(BILLING)
                .bind(&env.id)
                .bind(env.partition_key())
                .bind(i64::try_from(env.version().unwrap_or_default())?)
                .execute(&mut **tx)
                .await?;
                Ok(())
            })
        });
        let consumer = Consumer::builder(self.store.clone(), Arc::clone(&self.broker))
            .lease(Duration::from_secs(2))
            .receive_wait(Duration::from_millis(50))
            .inbox_retention(None)
            .group(group)
            .build()
            .expect("consumer");
        tokio::spawn(async move {
            consumer.run(std::future::pending()).await;
        })
    }

    /// Commits event `i`; a failed or unknown commit is resolved by reading
    /// the outbox row back, never by guessing.
    async fn commit_event(&self, i: usize) {
        let event_id = format!("ev-{i:04}");
        let key = format!("order-{}", i % KEYS);
        let version = u64::try_from(i / KEYS + 1).expect("small");
        loop {
            match self.try_commit(&event_id, &key, version).await {
                Ok(()) => break,
                Err(err) => {
                    eprintln!("commit of {event_id} failed ({err}); reading back");
                    if self.read_back(&event_id).await {
                        break;
                    }
                }
            }
        }
        self.ledger.committed(event_id, key, version);
    }

    async fn try_commit(
        &self,
        event_id: &str,
        key: &str,
        version: u64,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let event = OrderChanged {
            order_id: key.to_owned(),
        };
        let mut envelope = Envelope::from_event("/test", &event, EventMeta::new(version))?;
        envelope.id = event_id.to_owned();
        let mut tx = self.store.begin().await?;
        self.outbox.append(&mut tx, TOPIC, &envelope).await?;
        self.outbox.commit(tx).await?;
        Ok(())
    }

    /// Whether the event's row committed, asking until the server answers.
    async fn read_back(&self, event_id: &str) -> bool {
        loop {
            match sqlx::query_scalar::<_, i32>("SELECT 1 FROM keel_outbox WHERE event_id = $1")
                .bind(event_id)
                .fetch_optional(self.store.pool())
                .await
            {
                Ok(row) => return row.is_some(),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Waits for `n` effects, then feeds the ledger what was published and
    /// applied (in effect commit order) and checks it.
    async fn settle_and_check(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let count: Result<i64, _> = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
                .fetch_one(self.store.pool())
                .await;
            if count
                .as_ref()
                .is_ok_and(|c| *c >= i64::try_from(n).expect("small"))
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {count:?} of {n} effects after 90 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Give redeliveries a moment to show up if they were to double apply.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for id in self.recorded.ids() {
            self.ledger.published(id);
        }
        let effects: Vec<String> = sqlx::query_scalar("SELECT event_id FROM effects ORDER BY seq")
            .fetch_all(self.store.pool())
            .await
            .expect("effects");
        for event_id in effects {
            self.ledger.applied(event_id, BILLING);
        }
        match self.ledger.check() {
            Ok(report) => {
                eprintln!(
                    "ledger: {n} committed, {} publishes, 0 lost, 0 duplicated effects \
                     ({report:?})",
                    self.recorded.len()
                );
            }
            Err(err) => panic!("ledger check failed: {err}"),
        }
    }
}

fn relay(
    world: &World,
    name: &str,
    broker: RecordingBroker,
    lease: Duration,
) -> OutboxRelay<PgStore, RecordingBroker> {
    OutboxRelay::builder(&world.outbox, Arc::new(broker))
        .name(name)
        .batch_size(NonZeroUsize::new(20).expect("non-zero"))
        .poll_interval(Duration::from_millis(20))
        .lease(lease)
        .build()
        .expect("relay")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_run_loses_and_duplicates_nothing() {
    let Some((store, _lease)) = common::fresh_store_alone().await else {
        return;
    };
    let world = Arc::new(world(store).await);
    let relay = relay(
        &world,
        "relay-1",
        world.recording_broker(),
        Duration::from_secs(5),
    );
    let relay = tokio::spawn(async move { relay.run(std::future::pending()).await });
    let consumer = world.spawn_consumer();

    const EVENTS: usize = 240;
    let restarted = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&restarted);
    let restarter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        tokio::task::spawn_blocking(|| services::restart(Service::Postgres))
            .await
            .expect("join")
            .expect("restart PostgreSQL");
        flag.store(true, Ordering::SeqCst);
        eprintln!("PostgreSQL restarted");
    });
    let mut after_restart = 0;
    for i in 0..EVENTS {
        world.commit_event(i).await;
        if restarted.load(Ordering::SeqCst) {
            after_restart += 1;
        }
        tokio::time::sleep(Duration::from_millis(8)).await;
    }
    restarter.await.expect("restarter");
    assert!(
        after_restart > 0 && after_restart < EVENTS,
        "the restart happened in the middle of the run ({after_restart} events after it)"
    );
    world.settle_and_check(EVENTS).await;
    relay.abort();
    consumer.abort();
}

/// A restart closes every idle session without sqlx knowing. Checkout pings
/// a session idle that long and replaces a dead one, so the statements
/// after the restart succeed instead of failing with a dead session's I/O
/// error, one per session the pool held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_idle_across_a_restart_are_replaced_at_checkout() {
    let Some((store, _lease)) = common::fresh_store_alone().await else {
        return;
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(store.pool().acquire().await.expect("a session"));
    }
    drop(held);
    tokio::task::spawn_blocking(|| services::restart(Service::Postgres))
        .await
        .expect("join")
        .expect("restart PostgreSQL");
    // Idle past the window in which a session back from a borrow is trusted.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for i in 0..3 {
        sqlx::query("SELECT 1")
            .execute(store.pool())
            .await
            .unwrap_or_else(|err| panic!("statement {i} after the restart: {err}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_batch_is_covered_by_its_replica() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let world = Arc::new(world(store).await);
    const EVENTS: usize = 100;
    for i in 0..EVENTS {
        world.commit_event(i).await;
    }
    let consumer = world.spawn_consumer();

    // Replica A publishes half of its first batch, then its process dies.
    let dying = world.recording_broker();
    dying.die_mid_batch.store(true, Ordering::SeqCst);
    let dying = Arc::new(dying);
    let a = OutboxRelay::builder(&world.outbox, Arc::clone(&dying))
        .name("relay-a")
        .batch_size(NonZeroUsize::new(20).expect("non-zero"))
        .poll_interval(Duration::from_millis(20))
        .lease(Duration::from_secs(1))
        .build()
        .expect("relay a");
    let a = tokio::spawn(async move { a.run(std::future::pending()).await });
    tokio::time::timeout(Duration::from_secs(10), dying.died.notified())
        .await
        .expect("relay A reached the middle of a batch");

    // Replica B is running when A is killed; it takes A's batch over once
    // A's lease ends and republishes it whole.
    let b = relay(
        &world,
        "relay-b",
        world.recording_broker(),
        Duration::from_secs(1),
    );
    let b = tokio::spawn(async move { b.run(std::future::pending()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.abort();

    world.settle_and_check(EVENTS).await;
    let publishes = world.recorded.len();
    assert!(
        publishes > EVENTS,
        "A's half batch was published twice ({publishes} publishes), and absorbed"
    );
    b.abort();
    consumer.abort();
}
