//! The crash matrix: the whole embedded pipeline, killed at every failpoint
//! between two durable steps, restarted from its files, and judged by the
//! ledger.
//!
//! One "process" is what an application embeds: business transactions
//! that write an order row and its event together, the outbox relay, the
//! SqliteBroker, a consumer with two groups (`billing`, and `fulfilment`,
//! which starts a saga in its inbox transaction for every new order), and
//! the saga orchestrator. Each process runs on its own tokio runtime over
//! two database files; a **crash** shuts that runtime down at once, so every
//! task stops at whatever await it was in and all in-memory state is lost
//! (kill -9, as far as a test can); the next process opens the same files.
//!
//! Each scenario arms one failpoint (or a seeded combination, plus seeded
//! kills at random moments) with `1*return`: the component stops dead right
//! after a durable step, exactly as if the process had died there, and the
//! harness kills the process as soon as the crash is reported (it watches
//! the components' tracing events). The failpoints are the library's eleven
//! (relay, consumer, saga) and two of the application's own, just before and
//! just after its business COMMIT. Processes are restarted until the
//! workload is done and drained; then the facts (the business table, the
//! broker's log as a fresh group reads it, the effect table in commit
//! order, the dead letters, the sagas, and what the saga's downstream
//! services applied) go into a [`Ledger`], which must find:
//!
//! - every committed event delivered and applied exactly once per group
//!   (the one poison event dead-lettered instead, by each group);
//! - no event of an aborted business transaction published or applied;
//! - per-key order of publication and of each group's effects;
//! - every saga completed or fully compensated, in reverse order.
//!
//! The workload and fault plan derive from a seed (`KEEL_CRASH_SEED`,
//! printed by every scenario); thread timing is not reproducible, so a seed
//! replays the plan, not the exact interleaving. Run one scenario with
//! output: `cargo nextest run -p keel-messaging --test crash_matrix
//! relay_after_publish --no-capture`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use keel_core::BoxError;
use keel_messaging::broker::{
    Broker, BrokerError, Message, SubscribeOptions, Subscription, header,
};
use keel_messaging::consumer::{Backoff, Consumer, Group, HandlerError, Jitter};
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::saga::{SagaDefinition, SagaOrchestrator, Step, StepContext};
use keel_messaging::store::{
    DeadLetterFilter, DeadLetterStore, OutboxStore, SagaFilter, SagaStatus, SagaStore, Store,
};
use keel_sqlite::broker::{SqliteBroker, SqliteBrokerOptions};
use keel_sqlite::store::SqliteStore;
use keel_testkit::ledger::{Ledger, LedgerReport};
use serde::{Deserialize, Serialize};
use sqlx::Row;
use tempfile::TempDir;
use tokio::time::Instant;

type Tx = <SqliteStore as Store>::Tx;

const TOPIC: &str = "orders";
const BILLING: &str = "billing";
const FULFILMENT: &str = "fulfilment";
const SOURCE: &str = "/services/orders";
const ORDER_CHANGED: &str = "shop.order.changed.v1";
/// An event type no group handles: dead-lettered as `unknown_type`.
const POISON_TYPE: &str = "shop.order.exploded.v1";
const POISON_ID: &str = "evt-poison";

const ORDERS: usize = 4;
const VERSIONS: u64 = 4;
const ABORTED: usize = 3;

const STEPS: [&str; 4] = [
    "capture_payment",
    "reserve_stock",
    "schedule_shipment",
    "send_receipt",
];
const PIVOT: &str = "schedule_shipment";

/// Every failpoint between two durable steps of the pipeline.
const FAILPOINTS: [&str; 11] = [
    "relay-after-claim",
    "relay-after-publish",
    "relay-after-mark",
    "consumer-after-inbox",
    "consumer-after-handler",
    "consumer-after-commit",
    "consumer-after-ack",
    "consumer-after-dead-letter",
    "keel-saga-after-claim",
    "keel-saga-after-step",
    "keel-saga-after-compensation",
];

/// Where the application itself dies around its business commit: after
/// writing the order and its event but before COMMIT (both must vanish),
/// and right after COMMIT (both must survive, and the event leave).
const BUSINESS_FAILPOINTS: [&str; 2] = ["business-before-commit", "business-after-commit"];

/// The longest one process may take to crash or drain before the scenario
/// fails as stalled.
const STALL: Duration = Duration::from_secs(20);

// ------------------------------------------------------------- scenarios --

macro_rules! crash_at {
    ($($test:ident => $failpoint:literal,)*) => {$(
        #[test]
        fn $test() {
            run_scenario(stringify!($test), &[$failpoint], 0);
        }
    )*};
}

crash_at! {
    relay_after_claim => "relay-after-claim",
    relay_after_publish => "relay-after-publish",
    relay_after_mark => "relay-after-mark",
    consumer_after_inbox => "consumer-after-inbox",
    consumer_after_handler => "consumer-after-handler",
    consumer_after_commit => "consumer-after-commit",
    consumer_after_ack => "consumer-after-ack",
    consumer_after_dead_letter => "consumer-after-dead-letter",
    saga_after_claim => "keel-saga-after-claim",
    saga_after_step => "keel-saga-after-step",
    saga_after_compensation => "keel-saga-after-compensation",
    business_before_commit => "business-before-commit",
    business_after_commit => "business-after-commit",
}

/// A few combinations chosen by the seed: two to four failpoints at once,
/// plus kills at random moments (mid-commit, mid-publish, mid-handler).
#[test]
fn random_combinations_by_seed() {
    let mut rng = Rng::new(seed() ^ 0xC0B1);
    for round in 0..3 {
        let mut pool = [FAILPOINTS.as_slice(), BUSINESS_FAILPOINTS.as_slice()].concat();
        let n = 2 + rng.below(3) as usize;
        let armed: Vec<&'static str> = (0..n)
            .map(|_| pool.swap_remove(rng.below(pool.len() as u64) as usize))
            .collect();
        let kills = 1 + rng.below(2) as usize;
        run_scenario(&format!("combination_{round}"), &armed, kills);
    }
}

/// Guards "every failpoint": a failpoint added to (or renamed in) the relay,
/// the consumer or the orchestrator must be added to the matrix too.
#[test]
fn the_matrix_covers_every_failpoint_in_the_code() {
    let mut in_code = BTreeSet::new();
    let sources = [
        (include_str!("../src/outbox/relay/mod.rs"), "fail_point!(\""),
        (include_str!("../src/consumer/process.rs"), "fail_point!(\""),
        (
            include_str!("../src/saga/orchestrator/call.rs"),
            "\"keel-saga-",
        ),
    ];
    for (source, marker) in sources {
        for (at, _) in source.match_indices(marker) {
            // The name starts after the marker's opening quote.
            let start = at + marker.find('"').unwrap_or(0) + 1;
            let name: String = source[start..].chars().take_while(|c| *c != '"').collect();
            in_code.insert(name);
        }
    }
    let matrix: BTreeSet<String> = FAILPOINTS.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(
        in_code, matrix,
        "the failpoints in the code and in the matrix differ"
    );
}

// ---------------------------------------------------------------- world --

/// What outlives every process: the files, the plan and how far the
/// business got through it, the downstream services, and the ledger.
struct World {
    dir: TempDir,
    plan: Plan,
    /// The next plan item the business has not finished.
    cursor: AtomicUsize,
    services: Arc<Services>,
    ledger: Ledger,
    /// Whether restarted relays reuse their name (and so their claims).
    stable_relay_name: bool,
    incarnation: AtomicUsize,
    /// Publish calls the broker accepted, by event id (republishes count).
    publish_calls: Arc<RwLock<BTreeMap<String, u32>>>,
}

impl World {
    fn new(rng: &mut Rng) -> Arc<Self> {
        let plan = Plan::new(rng);
        let ledger = Ledger::with_handlers([BILLING, FULFILMENT]);
        let services = Arc::new(Services {
            ledger: ledger.clone(),
            refuse: plan.refuse.clone(),
            applied: RwLock::default(),
            calls: AtomicUsize::new(0),
        });
        Arc::new(Self {
            dir: tempfile::tempdir().expect("temp dir"),
            plan,
            cursor: AtomicUsize::new(0),
            services,
            ledger,
            stable_relay_name: rng.below(2) == 0,
            incarnation: AtomicUsize::new(0),
            publish_calls: Arc::default(),
        })
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    fn plan_done(&self) -> bool {
        self.cursor.load(Ordering::SeqCst) >= self.plan.items.len()
    }

    /// Events the relay published more than once (after a crash between
    /// publish and mark).
    fn republished(&self) -> usize {
        let calls = self
            .publish_calls
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        calls.values().filter(|n| **n > 1).count()
    }
}

/// The broker as the relay sees it, counting accepted publishes from outside
/// the process (so the count survives crashes).
struct TappedBroker {
    inner: Arc<SqliteBroker>,
    calls: Arc<RwLock<BTreeMap<String, u32>>>,
}

#[async_trait]
impl Broker for TappedBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.inner.publish(messages).await?;
        let mut calls = self.calls.write().unwrap_or_else(PoisonError::into_inner);
        for message in messages {
            let id = message.header(header::EVENT_ID).unwrap_or(&message.id);
            *calls.entry(id.to_owned()).or_default() += 1;
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

/// One business transaction of the workload.
#[derive(Debug, Clone)]
enum Item {
    /// Writes the order row and its event, and commits.
    Commit {
        event_id: String,
        order: String,
        version: u64,
        ty: &'static str,
    },
    /// Writes the order row and its event, then rolls back (or drops the
    /// transaction, as an error path would).
    Abort {
        event_id: String,
        order: String,
        drop_tx: bool,
    },
}

/// The seeded workload: four orders of four versions each, interleaved,
/// with aborted transactions and one poison event among them.
struct Plan {
    items: Vec<Item>,
    pauses: Vec<Duration>,
    /// Orders whose shipment is refused: their sagas must compensate.
    refuse: BTreeSet<String>,
}

impl Plan {
    fn new(rng: &mut Rng) -> Self {
        let mut next = [1_u64; ORDERS];
        let mut items = Vec::new();
        loop {
            let open: Vec<usize> = (0..ORDERS).filter(|&o| next[o] <= VERSIONS).collect();
            if open.is_empty() {
                break;
            }
            let o = open[rng.below(open.len() as u64) as usize];
            items.push(Item::Commit {
                event_id: format!("evt-order-{o}-v{}", next[o]),
                order: format!("order-{o}"),
                version: next[o],
                ty: ORDER_CHANGED,
            });
            next[o] += 1;
        }
        for n in 0..ABORTED {
            let at = rng.below(items.len() as u64 + 1) as usize;
            let o = rng.below(ORDERS as u64);
            items.insert(
                at,
                Item::Abort {
                    event_id: format!("evt-aborted-{n}"),
                    order: format!("order-{o}"),
                    drop_tx: n == 0,
                },
            );
        }
        let at = rng.below(items.len() as u64 + 1) as usize;
        items.insert(
            at,
            Item::Commit {
                event_id: POISON_ID.to_owned(),
                order: "poison".to_owned(),
                version: 1,
                ty: POISON_TYPE,
            },
        );
        let pauses = items
            .iter()
            .map(|_| Duration::from_millis(rng.below(12)))
            .collect();
        // At least one saga of each ending.
        let mut refuse = BTreeSet::new();
        for o in 0..ORDERS {
            if o == 0 || (o > 1 && rng.below(2) == 0) {
                refuse.insert(format!("order-{o}"));
            }
        }
        Self {
            items,
            pauses,
            refuse,
        }
    }

    fn committed(&self) -> impl Iterator<Item = &str> {
        self.items.iter().filter_map(|item| match item {
            Item::Commit { event_id, .. } => Some(event_id.as_str()),
            Item::Abort { .. } => None,
        })
    }

    fn aborted(&self) -> impl Iterator<Item = &str> {
        self.items.iter().filter_map(|item| match item {
            Item::Abort { event_id, .. } => Some(event_id.as_str()),
            Item::Commit { .. } => None,
        })
    }
}

// ------------------------------------------------- downstream services --

/// The services the saga calls (payments, stock, shipping, mail). They live
/// outside the crashing process and dedupe on the idempotency key, as a
/// payment API does; each effect is reported to the ledger once.
struct Services {
    ledger: Ledger,
    refuse: BTreeSet<String>,
    applied: RwLock<HashSet<String>>,
    calls: AtomicUsize,
}

impl Services {
    fn call(&self, saga_id: &str, step: &str, key: &str) -> Result<(), BoxError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let undo = key.contains(":undo:");
        if !undo && step == PIVOT && self.refuse.contains(saga_id) {
            return Err(format!("no carrier will take order {saga_id}").into());
        }
        let mut applied = self.applied.write().unwrap_or_else(PoisonError::into_inner);
        if applied.insert(key.to_owned()) {
            if undo {
                self.ledger.saga_compensation(saga_id, step);
            } else {
                self.ledger.saga_action(saga_id, step);
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderChanged {
    order_id: String,
}

impl Event for OrderChanged {
    const TYPE: &'static str = ORDER_CHANGED;
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Fulfilment {
    order_id: String,
}

fn saga_definition(services: &Arc<Services>) -> SagaDefinition<Fulfilment> {
    let call = |services: &Arc<Services>| {
        let services = Arc::clone(services);
        move |ctx: StepContext<Fulfilment>| {
            let services = Arc::clone(&services);
            async move { services.call(ctx.saga_id(), ctx.step(), ctx.idempotency_key()) }
        }
    };
    let step = |name: &'static str| {
        Step::new(name, call(services))
            .timeout(Duration::from_millis(200))
            .max_attempts(5)
    };
    let fast = Backoff::exponential(Duration::from_millis(5), 2.0, Duration::from_millis(20))
        .and_then(|b| b.with_jitter(Jitter::None))
        .expect("backoff");
    SagaDefinition::builder("order_fulfilment")
        .step(step(STEPS[0]).compensate_with(call(services)))
        .step(step(STEPS[1]).compensate_with(call(services)))
        .pivot(step(STEPS[2]))
        .step(step(STEPS[3]))
        .backoff(fast)
        .stuck_after(10)
        .forward_budget(Duration::from_millis(300))
        .build()
        .expect("saga definition")
}

// -------------------------------------------------------------- process --

/// The pieces of a running process the harness looks at.
struct Process {
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
    orchestrator: SagaOrchestrator<SqliteStore>,
}

fn fast_backoff() -> Backoff {
    Backoff::exponential(Duration::from_millis(10), 2.0, Duration::from_millis(100))
        .and_then(|b| b.with_jitter(Jitter::None))
        .expect("backoff")
}

async fn open(world: &World) -> (SqliteStore, Arc<SqliteBroker>) {
    let store = SqliteStore::open(world.path("app.db"))
        .await
        .expect("open store");
    for ddl in [
        "CREATE TABLE IF NOT EXISTS orders (event_id TEXT PRIMARY KEY, order_id TEXT NOT NULL,
                                            version INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS effects (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                                             grp TEXT NOT NULL, event_id TEXT NOT NULL,
                                             order_id TEXT NOT NULL, version INTEGER NOT NULL)",
    ] {
        sqlx::query(ddl)
            .execute(store.pool())
            .await
            .expect("schema");
    }
    let options = SqliteBrokerOptions::new().poll_interval(Duration::from_millis(20));
    let broker = options
        .open(world.path("broker.db"))
        .await
        .expect("open broker");
    (store, Arc::new(broker))
}

/// Starts a process: the business workload from where it stopped, the
/// relay, the consumer and the orchestrator.
async fn boot(world: &Arc<World>) -> Process {
    let incarnation = world.incarnation.fetch_add(1, Ordering::SeqCst) + 1;
    let (store, broker) = open(world).await;
    let outbox = Outbox::new(store.clone());
    let definition = saga_definition(&world.services);
    let orchestrator = SagaOrchestrator::builder(store.clone())
        .saga(&definition)
        .poll_interval(Duration::from_millis(20))
        .lease_grace(Duration::from_millis(50))
        .build()
        .expect("orchestrator");

    tokio::spawn(business(Arc::clone(world), outbox.clone()));

    let name = if world.stable_relay_name {
        "relay-main".to_owned()
    } else {
        format!("relay-{incarnation}")
    };
    let tapped = Arc::new(TappedBroker {
        inner: Arc::clone(&broker),
        calls: Arc::clone(&world.publish_calls),
    });
    let relay = OutboxRelay::builder(&outbox, tapped)
        .name(name)
        .lease(Duration::from_millis(300))
        .poll_interval(Duration::from_millis(20))
        .batch_size(NonZeroUsize::new(8).expect("non-zero"))
        .backoff(fast_backoff())
        .build()
        .expect("relay");
    let (w, s) = (Arc::clone(world), store.clone());
    tokio::spawn(async move {
        // The relay comes up a moment after the business, so its first
        // round has rows to claim (and `relay-after-claim` means something).
        while !w.plan_done()
            && s.outbox_stats()
                .await
                .map_or(true, |st| st.unpublished == 0)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        relay.run(std::future::pending()).await;
    });

    let consumer = Consumer::builder(store.clone(), Arc::clone(&broker))
        .lease(Duration::from_millis(400))
        .receive_wait(Duration::from_millis(50))
        .backoff(fast_backoff())
        .max_in_flight(NonZeroUsize::new(8).expect("non-zero"))
        .max_deliveries(NonZeroU32::new(10).expect("non-zero"))
        .inbox_retention(None)
        .group(billing())
        .group(fulfilment(&orchestrator, &definition))
        .build()
        .expect("consumer");
    tokio::spawn(consumer.run(std::future::pending()));
    let running = orchestrator.clone();
    tokio::spawn(async move { running.run(std::future::pending()).await });

    Process {
        store,
        broker,
        orchestrator,
    }
}

/// The operator. A crash during an attempt at the pivot leaves it "maybe
/// sent": the saga only goes forward, and when the carrier keeps refusing,
/// it is parked stuck after its forward budget. The operator looks the
/// shipment up (the harness knows the carrier refused every request for
/// this order, so none exists) and says so; the saga then compensates.
async fn operate(world: &World, p: &Process) {
    let filter = SagaFilter {
        status: Some(SagaStatus::Stuck),
        ..SagaFilter::default()
    };
    let Ok(stuck) = p.orchestrator.list(&filter).await else {
        return;
    };
    for view in stuck {
        let saga = &view.record;
        let at_pivot = view.step_name.as_deref() == Some(PIVOT);
        assert!(
            at_pivot && saga.outcome_unknown && world.plan.refuse.contains(&saga.id),
            "only a refused pivot that may have been sent may be stuck: {saga:?}"
        );
        // Racing another process's operator is fine: one of them wins.
        let _ = p.orchestrator.confirm_not_applied(&saga.id).await;
    }
}

/// Works through the plan from the cursor. An item interrupted by a crash
/// is redone unless its order row shows it committed (resolve by reading
/// back, never by guessing).
async fn business(world: Arc<World>, outbox: Outbox<SqliteStore>) {
    loop {
        let at = world.cursor.load(Ordering::SeqCst);
        let Some(item) = world.plan.items.get(at) else {
            return;
        };
        match run_item(&outbox, item).await {
            Ok(()) => {
                world.cursor.store(at + 1, Ordering::SeqCst);
                tokio::time::sleep(world.plan.pauses[at]).await;
            }
            Err(err) if err.to_string().starts_with("simulated crash") => return,
            Err(err) => {
                eprintln!("business transaction {item:?} failed, retrying: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn run_item(outbox: &Outbox<SqliteStore>, item: &Item) -> Result<(), BoxError> {
    let store = outbox.store();
    match item {
        Item::Commit {
            event_id,
            order,
            version,
            ty,
        } => {
            let done = sqlx::query("SELECT 1 FROM orders WHERE event_id = ?")
                .bind(event_id)
                .fetch_optional(store.read_pool())
                .await?;
            if done.is_some() {
                return Ok(());
            }
            let mut tx = store.begin().await?;
            write_order(outbox, &mut tx, event_id, order, *version, ty).await?;
            fail::fail_point!("business-before-commit", |_| Err(crashed(
                "business-before-commit"
            )));
            outbox.commit(tx).await?;
            fail::fail_point!("business-after-commit", |_| Err(crashed(
                "business-after-commit"
            )));
        }
        Item::Abort {
            event_id,
            order,
            drop_tx,
        } => {
            let mut tx = store.begin().await?;
            write_order(outbox, &mut tx, event_id, order, 0, ORDER_CHANGED).await?;
            if *drop_tx {
                drop(tx);
            } else {
                store.rollback(tx).await?;
            }
        }
    }
    Ok(())
}

/// The application "dies" at a business failpoint: nothing after it runs,
/// and the harness kills the process.
fn crashed(failpoint: &'static str) -> BoxError {
    report_crash(failpoint);
    format!("simulated crash at {failpoint}").into()
}

async fn write_order(
    outbox: &Outbox<SqliteStore>,
    tx: &mut Tx,
    event_id: &str,
    order: &str,
    version: u64,
    ty: &str,
) -> Result<(), BoxError> {
    sqlx::query("INSERT INTO orders (event_id, order_id, version) VALUES (?, ?, ?)")
        .bind(event_id)
        .bind(order)
        .bind(i64::try_from(version)?)
        .execute(&mut **tx)
        .await?;
    let changed = OrderChanged {
        order_id: order.to_owned(),
    };
    let mut envelope = Envelope::from_event(SOURCE, &changed, EventMeta::new(version))?;
    envelope.id = event_id.to_owned();
    envelope.ty = ty.to_owned();
    outbox.append(tx, TOPIC, &envelope).await?;
    Ok(())
}

/// The effect: a row in the consumer's transaction, next to its inbox row.
async fn record_effect(tx: &mut Tx, group: &str, envelope: &Envelope) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (grp, event_id, order_id, version) VALUES (?, ?, ?, ?)")
        .bind(group)
        .bind(&envelope.id)
        .bind(envelope.partition_key())
        .bind(i64::try_from(envelope.version().unwrap_or_default())?)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn billing() -> Group<Tx> {
    Group::new(TOPIC, BILLING).on_event(|tx: &mut Tx, _: OrderChanged, envelope| {
        Box::pin(async move { record_effect(tx, BILLING, envelope).await })
    })
}

/// Records its effect and, for a new order, starts its saga in the same
/// transaction: the saga exists if and only if the event was applied.
fn fulfilment(
    orchestrator: &SagaOrchestrator<SqliteStore>,
    definition: &SagaDefinition<Fulfilment>,
) -> Group<Tx> {
    let (orchestrator, definition) = (orchestrator.clone(), definition.clone());
    Group::new(TOPIC, FULFILMENT).on_event(move |tx: &mut Tx, ev: OrderChanged, envelope| {
        let (orchestrator, definition) = (orchestrator.clone(), definition.clone());
        Box::pin(async move {
            record_effect(tx, FULFILMENT, envelope).await?;
            if envelope.version() == Some(1) {
                let saga = Fulfilment {
                    order_id: ev.order_id.clone(),
                };
                orchestrator
                    .start(tx, &definition, &ev.order_id, &saga)
                    .await?;
            }
            Ok(())
        })
    })
}

// -------------------------------------------------------------- harness --

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// A failpoint fired: killed right after.
    Crashed,
    /// Killed at a random moment.
    Killed,
    /// Everything done and drained.
    Quiet,
}

/// Runs one process on its own runtime until it crashes, is killed, or
/// has nothing left to do; then shuts the runtime down (the kill).
fn run_process(world: &Arc<World>, kill_after: Option<Duration>) -> Ending {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let ending = runtime.block_on(async {
        let crashes_before = crash_watch_total();
        let started = Instant::now();
        let process = boot(world).await;
        loop {
            if crash_watch_total() > crashes_before {
                return Ending::Crashed;
            }
            if kill_after.is_some_and(|after| started.elapsed() >= after) {
                return Ending::Killed;
            }
            operate(world, &process).await;
            if quiescent(world, &process).await {
                return Ending::Quiet;
            }
            if started.elapsed() > STALL {
                panic!("stalled: {}", diagnose(world, &process).await);
            }
            tokio::select! {
                () = CRASH_WOKEN.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(15)) => {}
            }
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    ending
}

/// Done: the plan finished, the outbox empty, every committed event handled
/// by both groups, every message settled, every saga finished.
async fn quiescent(world: &World, p: &Process) -> bool {
    if !world.plan_done() {
        return false;
    }
    let Ok(stats) = p.store.outbox_stats().await else {
        return false;
    };
    let count = |sql: &'static str, pool: &sqlx::SqlitePool| {
        let pool = pool.clone();
        async move {
            sqlx::query(sql)
                .fetch_one(&pool)
                .await
                .map_or(-1, |row| row.get::<i64, _>(0))
        }
    };
    let reader = p.store.read_pool();
    let committed = count("SELECT COUNT(*) FROM orders", reader).await;
    let handled = count(
        "SELECT (SELECT COUNT(DISTINCT grp || ' ' || event_id) FROM effects)
              + (SELECT COUNT(*) FROM keel_dead_letters)",
        reader,
    )
    .await;
    let sagas = count("SELECT COUNT(*) FROM keel_sagas", reader).await;
    let running = count(
        "SELECT COUNT(*) FROM keel_sagas WHERE status IN ('running', 'compensating')",
        reader,
    )
    .await;
    let pending = count("SELECT COUNT(*) FROM keel_broker_pending", p.broker.pool()).await;
    stats.unpublished == 0
        && committed >= world.plan.committed().count() as i64
        && handled == 2 * committed
        && sagas == ORDERS as i64
        && running == 0
        && pending == 0
}

async fn diagnose(world: &World, p: &Process) -> String {
    let stats = p.store.outbox_stats().await;
    let sagas = p.store.saga_list(&SagaFilter::default()).await.map(|list| {
        list.iter()
            .map(|s| format!("{}={}@{}", s.id, s.status.as_str(), s.step))
            .collect::<Vec<_>>()
    });
    let effects: Result<i64, _> = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(p.store.read_pool())
        .await;
    let pending: Result<Vec<(i64, i64, i64)>, _> =
        sqlx::query_as("SELECT seq, leased, delivery_count FROM keel_broker_pending ORDER BY seq")
            .fetch_all(p.broker.pool())
            .await;
    format!(
        "plan at {}/{}; outbox {stats:?}; effects {effects:?}; sagas {sagas:?}; \
         broker pending {pending:?}",
        world.cursor.load(Ordering::SeqCst),
        world.plan.items.len()
    )
}

fn seed() -> u64 {
    std::env::var("KEEL_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_CAFE)
}

/// Arms `armed` (each fires once), runs processes until every one fired and
/// the workload drained, then checks the ledger.
fn run_scenario(name: &str, armed: &[&'static str], kills: usize) {
    let failpoints = fail::FailScenario::setup();
    install_crash_watch();
    let seed = seed();
    let mut rng = Rng::new(seed ^ fnv(name));
    let world = World::new(&mut rng);
    let mut kill_plan: Vec<Duration> = (0..kills)
        .map(|_| Duration::from_millis(40 + rng.below(260)))
        .collect();
    let seen_before = crash_watch_seen();
    for failpoint in armed {
        fail::cfg(*failpoint, "1*return").expect("failpoint");
    }
    let clock = Instant::now();
    let mut endings = Vec::new();
    loop {
        assert!(endings.len() < 25, "{name}: no end in sight: {endings:?}");
        // A planned kill waits for a process that lives long enough.
        let ending = run_process(&world, kill_plan.last().copied());
        if ending == Ending::Killed {
            kill_plan.pop();
        }
        endings.push(ending);
        if ending != Ending::Quiet {
            continue;
        }
        let seen = crash_watch_seen();
        let unfired: Vec<&str> = armed
            .iter()
            .copied()
            .filter(|fp| {
                seen.get(fp).copied().unwrap_or(0) <= seen_before.get(fp).copied().unwrap_or(0)
            })
            .collect();
        assert!(
            unfired.is_empty(),
            "{name}: drained, but {unfired:?} never fired (seed {seed})"
        );
        break;
    }
    // Authoritative, and independent of log lines: each armed failpoint's
    // one firing was used up.
    for failpoint in armed {
        assert!(
            fail::eval(failpoint, |_| ()).is_none(),
            "{name}: {failpoint} never fired (seed {seed})"
        );
        fail::remove(failpoint);
    }
    let report = verify(&world).unwrap_or_else(|err| panic!("{name} (seed {seed}): {err}"));
    if armed.contains(&"relay-after-publish") {
        // The outbox republishes after a relay crash, and the
        // consumer still applies once (the ledger checked that).
        assert!(world.republished() > 0, "{name}: nothing was republished");
    }
    let crashes = endings.iter().filter(|e| **e == Ending::Crashed).count();
    let killed = endings.iter().filter(|e| **e == Ending::Killed).count();
    println!(
        "{name} (seed {seed}, armed {armed:?}): {} processes, {crashes} crashes, {killed} kills, \
         {} events republished by the relay, {} saga calls, {:?}: {report}",
        endings.len(),
        world.republished(),
        world.services.calls.load(Ordering::SeqCst),
        clock.elapsed(),
    );
    failpoints.teardown();
}

/// Reads every fact back (in a fresh process, itself a restart) and has
/// the ledger judge them; then checks this workload's expected endings.
fn verify(world: &Arc<World>) -> Result<LedgerReport, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (checked, sagas) = runtime.block_on(async {
        let (store, broker) = open(world).await;
        feed_ledger(world, &store, &broker).await;
        let filter = SagaFilter {
            limit: Some(1_000),
            ..SagaFilter::default()
        };
        let sagas: BTreeMap<String, SagaStatus> = store
            .saga_list(&filter)
            .await
            .expect("sagas")
            .into_iter()
            .map(|s| (s.id, s.status))
            .collect();
        (world.ledger.check(), sagas)
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    let report = checked.map_err(|e| e.to_string())?;
    let expect = |ok: bool, what: String| if ok { Ok(()) } else { Err(what) };
    expect(
        report.committed == world.plan.committed().count(),
        format!("only {} of the plan's events committed", report.committed),
    )?;
    expect(
        report.aborted == ABORTED,
        format!("{} aborted", report.aborted),
    )?;
    let poison = |g: &str| (POISON_ID.to_owned(), g.to_owned());
    expect(
        report.dead_lettered == [poison(BILLING), poison(FULFILMENT)],
        format!("dead letters: {:?}", report.dead_lettered),
    )?;
    expect(sagas.len() == ORDERS, format!("sagas: {sagas:?}"))?;
    for (order, status) in &sagas {
        // The ledger proved each ended completed or fully compensated; the
        // workload decides which.
        let expected = if world.plan.refuse.contains(order) {
            SagaStatus::Compensated
        } else {
            SagaStatus::Completed
        };
        expect(
            *status == expected,
            format!("saga {order} ended {status:?}, expected {expected:?}"),
        )?;
    }
    Ok(report)
}

async fn feed_ledger(world: &World, store: &SqliteStore, broker: &SqliteBroker) {
    let ledger = &world.ledger;
    let rows = sqlx::query("SELECT event_id, order_id, version FROM orders")
        .fetch_all(store.read_pool())
        .await
        .expect("orders");
    for row in rows {
        let version: i64 = row.get(2);
        ledger.committed(
            row.get::<String, _>(0),
            row.get::<String, _>(1),
            u64::try_from(version).unwrap_or(0),
        );
    }
    for id in world.plan.aborted() {
        ledger.aborted(id);
    }
    // What the broker holds, in the order a new group receives it.
    let mut audit = broker
        .subscribe(SubscribeOptions::new(TOPIC, "audit").lease(Duration::from_secs(30)))
        .await
        .expect("subscribe");
    loop {
        let batch = audit
            .receive(256, Duration::from_millis(100))
            .await
            .expect("receive");
        if batch.is_empty() {
            break;
        }
        for delivery in batch {
            let id = delivery
                .message
                .header(header::EVENT_ID)
                .unwrap_or_default();
            ledger.published(id);
            delivery.ack().await.expect("ack");
        }
    }
    let effects = sqlx::query("SELECT event_id, grp FROM effects ORDER BY seq")
        .fetch_all(store.read_pool())
        .await
        .expect("effects");
    for row in effects {
        ledger.applied(row.get::<String, _>(0), row.get::<String, _>(1));
    }
    let filter = DeadLetterFilter {
        limit: Some(1_000),
        ..DeadLetterFilter::default()
    };
    for letter in store.dead_letter_list(&filter).await.expect("dead letters") {
        let id = letter
            .message
            .header(header::EVENT_ID)
            .unwrap_or(&letter.message.id)
            .to_owned();
        ledger.dead_lettered(id, letter.group);
    }
    let filter = SagaFilter {
        limit: Some(1_000),
        ..SagaFilter::default()
    };
    for saga in store.saga_list(&filter).await.expect("sagas") {
        ledger.saga_started(saga.id.clone(), STEPS);
        ledger.saga_ended(saga.id, saga.status);
    }
}

// ---------------------------------------------------------- crash watch --

/// Events that reported a simulated crash, by failpoint.
static CRASH_SEEN: LazyLock<RwLock<BTreeMap<&'static str, u64>>> = LazyLock::new(Default::default);
static CRASH_TOTAL: AtomicU64 = AtomicU64::new(0);
static CRASH_WOKEN: LazyLock<tokio::sync::Notify> = LazyLock::new(tokio::sync::Notify::new);

fn crash_watch_total() -> u64 {
    CRASH_TOTAL.load(Ordering::SeqCst)
}

fn crash_watch_seen() -> BTreeMap<&'static str, u64> {
    CRASH_SEEN
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Counts a simulated crash and wakes the harness to kill the process.
fn report_crash(failpoint: &'static str) {
    *CRASH_SEEN
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(failpoint)
        .or_default() += 1;
    CRASH_TOTAL.fetch_add(1, Ordering::SeqCst);
    CRASH_WOKEN.notify_one();
}

fn install_crash_watch() {
    // Another test in this binary may have installed it already.
    let _ = tracing::subscriber::set_global_default(CrashWatch);
}

/// A tracing subscriber that listens to Keel's messaging components only and
/// notices when one reports a failpoint's simulated crash (the relay's
/// failed round, the consumer's `Crashed` outcome, the orchestrator's
/// crash point), so the harness can kill the process at once.
struct CrashWatch;

impl CrashWatch {
    fn watched(metadata: &tracing::Metadata<'_>) -> bool {
        metadata.is_event() && metadata.target().starts_with("keel_messaging")
    }
}

impl tracing::Subscriber for CrashWatch {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if Self::watched(metadata) {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        Self::watched(metadata)
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut finder = FailpointFinder(None);
        event.record(&mut finder);
        if let Some(failpoint) = finder.0 {
            report_crash(failpoint);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

struct FailpointFinder(Option<&'static str>);

impl tracing::field::Visit for FailpointFinder {
    fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        if let Some(failpoint) = FAILPOINTS.iter().find(|fp| text.contains(**fp)) {
            self.0 = Some(failpoint);
        }
    }
}

// ------------------------------------------------------------------ rng --

/// SplitMix64: tiny, seedable, good enough to shuffle a workload.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-ish in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}
