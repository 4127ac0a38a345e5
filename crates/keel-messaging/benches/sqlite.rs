//! Durable messaging on the embedded default, measured against what the
//! disk allows: SQLite's raw insert-and-commit rate, taken in the same run,
//! on the same kind of file.
//!
//! Every commit here is what an application pays for durability: WAL mode,
//! `synchronous = FULL` (an fsync per commit), `BEGIN IMMEDIATE` on the
//! store's single writer connection. So the honest yardstick for the
//! messaging machinery is not "messages per second" in a vacuum but "how
//! close to the rate at which the application can commit its own business
//! rows one transaction at a time":
//!
//! - `raw_insert_commit`: one 256-byte row per transaction (measured first
//!   and again last; the summary uses both, and also 100 raw inserts timed
//!   right before every relay and consumer sample, because on a shared
//!   machine the disk's fsync time drifts within seconds);
//! - `relay_drain`: N rows pre-filled in the outbox, the relay (claim,
//!   publish to the SqliteBroker, mark) drains them; goal at least 0.9 of raw;
//! - `consumer_drain`: N messages pre-published, a consumer with the inbox
//!   (receive, inbox row and effect row in one transaction, commit, ack)
//!   drains them; goal at least 0.8 of raw;
//! - `append_to_effect`: one business transaction appends an event while the
//!   relay and a consumer run; the time from its commit to the commit of the
//!   consumer's effect, one event at a time (criterion shows the mean; the
//!   summary prints p50 and p99).
//!
//! Run (about a minute and a half):
//!
//! ```text
//! cargo bench -p keel-messaging --bench sqlite -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! The store and the broker live in two files in one temporary directory,
//! as in the crash matrix and the quick start.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use criterion::Criterion;
use keel_core::clock::{self, Instant};
use keel_messaging::broker::{
    Broker, BrokerError, Delivery, DeliveryControl, Message, SubscribeOptions, Subscription,
};
use keel_messaging::consumer::{Consumer, Group, HandlerError};
use keel_messaging::envelope::Envelope;
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::Store;
use keel_sqlite::broker::SqliteBroker;
use keel_sqlite::store::SqliteStore;
use keel_testkit::bench::{self, OrderPlaced, Tally, order};
use tempfile::TempDir;
use tokio::runtime::Runtime;
use tokio::sync::{Notify, watch};

type Tx = <SqliteStore as Store>::Tx;

/// The body of a raw row: about the size of an encoded order event.
const ROW_BYTES: usize = 256;

// ---------------------------------------------------------------- tally --

static RAW_FIRST: LazyLock<Tally> = LazyLock::new(Tally::default);
static RAW_LAST: LazyLock<Tally> = LazyLock::new(Tally::default);
static RELAY: LazyLock<Tally> = LazyLock::new(Tally::default);
static CONSUMER: LazyLock<Tally> = LazyLock::new(Tally::default);
/// Raw inserts timed right before each relay (consumer) sample, so the
/// ratio compares like with like on a machine whose disk and CPU are shared.
static RELAY_RAW: LazyLock<Tally> = LazyLock::new(Tally::default);
static CONSUMER_RAW: LazyLock<Tally> = LazyLock::new(Tally::default);

/// Raw inserts timed next to each throughput sample.
const ADJACENT_RAW: u64 = 100;
static LATENCIES: LazyLock<RwLock<Vec<Duration>>> = LazyLock::new(Default::default);

// -------------------------------------------------------------- fixture --

struct Fixture {
    _dir: TempDir,
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
    outbox: Outbox<SqliteStore>,
    body: Vec<u8>,
    next_raw: AtomicU64,
    next_event: AtomicU64,
}

impl Fixture {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        // Defaults: WAL, synchronous = FULL, one writer connection.
        let store = SqliteStore::open(dir.path().join("app.db"))
            .await
            .expect("store");
        for ddl in [
            "CREATE TABLE raw (id INTEGER PRIMARY KEY, body BLOB NOT NULL)",
            "CREATE TABLE orders (id TEXT PRIMARY KEY, total_minor INTEGER NOT NULL)",
            "CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                                   event_id TEXT NOT NULL, order_id TEXT NOT NULL)",
        ] {
            sqlx::query(ddl)
                .execute(store.pool())
                .await
                .expect("schema");
        }
        // Defaults: WAL, synchronous = FULL.
        let broker = SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .expect("broker");
        Self {
            _dir: dir,
            outbox: Outbox::new(store.clone()),
            store,
            broker: Arc::new(broker),
            body: vec![b'x'; ROW_BYTES],
            next_raw: AtomicU64::new(0),
            next_event: AtomicU64::new(0),
        }
    }

    fn events(&self, n: u64) -> std::ops::Range<u64> {
        let first = self.next_event.fetch_add(n, Ordering::Relaxed);
        first..first + n
    }

    /// `n` business transactions of one row each: the yardstick.
    async fn raw_inserts(&self, n: u64) -> Duration {
        let first = self.next_raw.fetch_add(n, Ordering::Relaxed);
        let started = clock::now();
        for id in first..first + n {
            let mut tx = self.store.begin().await.expect("begin");
            sqlx::query("INSERT INTO raw (id, body) VALUES (?, ?)")
                .bind(i64::try_from(id).unwrap_or(i64::MAX))
                .bind(self.body.as_slice())
                .execute(&mut *tx)
                .await
                .expect("insert");
            self.store.commit(tx).await.expect("commit");
        }
        started.elapsed()
    }

    /// Appends `n` events to `topic`, 500 per transaction (untimed setup).
    async fn fill_outbox(&self, topic: &str, n: u64) {
        let events: Vec<Envelope> = self.events(n).map(order).collect();
        for chunk in events.chunks(500) {
            let mut tx = self.store.begin().await.expect("begin");
            self.outbox
                .append_all(&mut tx, topic, chunk)
                .await
                .expect("append");
            self.store.commit(tx).await.expect("commit");
        }
    }

    /// Publishes `n` events straight to the broker (untimed setup).
    async fn fill_topic(&self, topic: &str, n: u64) {
        let messages: Vec<Message> = self
            .events(n)
            .map(|i| {
                self.outbox
                    .record(topic, &order(i))
                    .expect("record")
                    .to_message()
            })
            .collect();
        for chunk in messages.chunks(256) {
            self.broker.publish(chunk).await.expect("publish");
        }
    }
}

/// The consumer's effect: one row, in the transaction that holds the inbox
/// row.
fn effect_group(topic: &str) -> Group<Tx> {
    Group::new(topic, "billing").on_event(|tx: &mut Tx, placed: OrderPlaced, envelope| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (event_id, order_id) VALUES (?, ?)")
                .bind(&envelope.id)
                .bind(&placed.order_id)
                .execute(&mut **tx)
                .await
                .map_err(HandlerError::from)?;
            Ok(())
        })
    })
}

// ------------------------------------------------------------ ack count --

/// The broker as the consumer sees it, counting acks so the benchmark knows
/// when the last message is done (acked is the end of "receive, commit,
/// ack").
struct CountingBroker {
    inner: Arc<SqliteBroker>,
    acks: Arc<AckCount>,
}

#[derive(Default)]
struct AckCount {
    acked: AtomicUsize,
    changed: Notify,
}

impl AckCount {
    async fn wait_for(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.acked.load(Ordering::Acquire) >= n {
                return;
            }
            changed.await;
        }
    }
}

#[async_trait]
impl Broker for CountingBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.inner.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        Ok(Box::new(CountingSubscription {
            inner: self.inner.subscribe(options).await?,
            acks: Arc::clone(&self.acks),
        }))
    }
}

struct CountingSubscription {
    inner: Box<dyn Subscription>,
    acks: Arc<AckCount>,
}

#[async_trait]
impl Subscription for CountingSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let batch = self.inner.receive(max, wait).await?;
        Ok(batch
            .into_iter()
            .map(|d| {
                let (message, count) = (d.message.clone(), d.delivery_count);
                let control = CountingControl {
                    inner: d,
                    acks: Arc::clone(&self.acks),
                };
                Delivery::new(message, count, Box::new(control))
            })
            .collect())
    }
}

struct CountingControl {
    inner: Delivery,
    acks: Arc<AckCount>,
}

#[async_trait]
impl DeliveryControl for CountingControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.inner.ack().await?;
        self.acks.acked.fetch_add(1, Ordering::AcqRel);
        self.acks.changed.notify_waiters();
        Ok(())
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

// ------------------------------------------------------ effect-commit hook --

/// When the consumer last counted an applied message: it increments
/// `keel_consumer_applied_total` right after the effect's commit returns
/// and before the ack, which makes the metric the commit's timestamp.
static APPLIED: LazyLock<watch::Sender<Option<Instant>>> =
    LazyLock::new(|| watch::Sender::new(None));

struct AppliedHook;

impl metrics::CounterFn for AppliedHook {
    fn increment(&self, _: u64) {
        APPLIED.send_replace(Some(clock::now()));
    }
    fn absolute(&self, _: u64) {}
}

/// A recorder that ignores every metric but the consumer's applied counter.
struct HookRecorder;

impl metrics::Recorder for HookRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == "keel_consumer_applied_total" {
            metrics::Counter::from_arc(Arc::new(AppliedHook))
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

// ----------------------------------------------------------- benchmarks --

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn bench_raw(
    c: &mut Criterion,
    rt: &Runtime,
    fx: &Arc<Fixture>,
    name: &str,
    tally: &'static Tally,
) {
    bench::timed(c, rt, "messaging", name, |iters| {
        let fx = Arc::clone(fx);
        async move {
            let took = fx.raw_inserts(iters).await;
            tally.add(iters, took);
            took
        }
    });
}

fn bench_relay(c: &mut Criterion, rt: &Runtime, fx: &Arc<Fixture>) {
    bench::timed(c, rt, "messaging", "relay_drain", |iters| {
        let fx = Arc::clone(fx);
        async move {
            fx.fill_outbox("bench.relay", iters).await;
            RELAY_RAW.add(ADJACENT_RAW, fx.raw_inserts(ADJACENT_RAW).await);
            // Defaults: batches of 100.
            let relay = OutboxRelay::builder(&fx.outbox, Arc::clone(&fx.broker))
                .build()
                .expect("relay");
            let started = clock::now();
            let mut published = 0;
            while published < iters {
                let n = relay.run_once().await.expect("relay round");
                assert!(n > 0, "the outbox ran dry after {published} of {iters}");
                published += n as u64;
            }
            let took = started.elapsed();
            RELAY.add(iters, took);
            took
        }
    });
}

fn bench_consumer(c: &mut Criterion, rt: &Runtime, fx: &Arc<Fixture>) {
    bench::timed(c, rt, "messaging", "consumer_drain", |iters| {
        let fx = Arc::clone(fx);
        async move {
            let topic = "bench.consume";
            fx.fill_topic(topic, iters).await;
            CONSUMER_RAW.add(ADJACENT_RAW, fx.raw_inserts(ADJACENT_RAW).await);
            let acks = Arc::new(AckCount::default());
            let broker = Arc::new(CountingBroker {
                inner: Arc::clone(&fx.broker),
                acks: Arc::clone(&acks),
            });
            // Defaults: 16 in flight, 30 s lease.
            let consumer = Consumer::builder(fx.store.clone(), broker)
                .receive_wait(Duration::from_millis(50))
                .inbox_retention(None)
                .group(effect_group(topic))
                .build()
                .expect("consumer");
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let started = clock::now();
            let running = tokio::spawn(consumer.run(async move {
                let _ = stopped.await;
            }));
            acks.wait_for(usize::try_from(iters).unwrap_or(usize::MAX))
                .await;
            let took = started.elapsed();
            let _ = stop.send(());
            running.await.expect("consumer");
            CONSUMER.add(iters, took);
            took
        }
    });
}

/// The relay and a consumer running for the latency benchmark, until
/// dropped.
struct Pipeline {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pipeline {
    /// Must run inside the runtime.
    fn start(fx: &Arc<Fixture>, topic: &str) -> Self {
        let (stop, _) = watch::channel(false);
        let relay = OutboxRelay::builder(&fx.outbox, Arc::clone(&fx.broker))
            .build()
            .expect("relay");
        let consumer = Consumer::builder(fx.store.clone(), Arc::clone(&fx.broker))
            .inbox_retention(None)
            .group(effect_group(topic))
            .build()
            .expect("consumer");
        let (mut relay_stop, mut consumer_stop) = (stop.subscribe(), stop.subscribe());
        let tasks = vec![
            tokio::spawn(async move {
                relay
                    .run(async move {
                        let _ = relay_stop.wait_for(|s| *s).await;
                    })
                    .await;
            }),
            tokio::spawn(async move {
                consumer
                    .run(async move {
                        let _ = consumer_stop.wait_for(|s| *s).await;
                    })
                    .await;
            }),
        ];
        Self { stop, tasks }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

fn bench_latency(c: &mut Criterion, rt: &Runtime, fx: &Arc<Fixture>) {
    let topic = "bench.latency";
    let pipeline = rt.block_on(async { Pipeline::start(fx, topic) });
    bench::timed(c, rt, "messaging", "append_to_effect", |iters| {
        let fx = Arc::clone(fx);
        async move {
            let mut total = Duration::ZERO;
            for i in fx.events(iters) {
                let took = one_round_trip(&fx, topic, i).await;
                LATENCIES
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(took);
                total += took;
            }
            total
        }
    });
    rt.block_on(pipeline.stop());
}

/// One business transaction (the order row and its event), then the wait
/// for the consumer's effect to commit.
async fn one_round_trip(fx: &Fixture, topic: &str, i: u64) -> Duration {
    let mut applied = APPLIED.subscribe();
    applied.mark_unchanged();
    let envelope = order(i);
    let mut tx = fx.store.begin().await.expect("begin");
    sqlx::query("INSERT INTO orders (id, total_minor) VALUES (?, ?)")
        .bind(&envelope.id)
        .bind(i64::try_from(i).unwrap_or(0))
        .execute(&mut *tx)
        .await
        .expect("order");
    fx.outbox
        .append(&mut tx, topic, &envelope)
        .await
        .expect("append");
    fx.outbox.commit(tx).await.expect("commit");
    let committed = clock::now();
    let at = applied
        .wait_for(|at| at.is_some_and(|at| at >= committed))
        .await
        .expect("applied");
    at.map_or(Duration::ZERO, |at| at.saturating_duration_since(committed))
}

// -------------------------------------------------------------- summary --

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn summary() {
    let (first, last) = (RAW_FIRST.per_second(), RAW_LAST.per_second());
    let raw = Tally::per_second_of(&[&RAW_FIRST, &RAW_LAST]);
    let (relay, consumer) = (RELAY.per_second(), CONSUMER.per_second());
    let (relay_raw, consumer_raw) = (RELAY_RAW.per_second(), CONSUMER_RAW.per_second());
    let mut latencies = LATENCIES
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    latencies.sort_unstable();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!();
    println!("== messaging summary (sqlite WAL, synchronous=FULL) ==");
    println!("raw insert+commit: {raw:.0} rows/s (first {first:.0}, last {last:.0})");
    println!(
        "relay drain:       {relay:.0} events/s = {:.2} x raw; {:.2} x the raw rate \
         measured next to it ({relay_raw:.0}/s) (goal >= 0.9)",
        relay / raw,
        relay / relay_raw
    );
    println!(
        "consumer drain:    {consumer:.0} events/s = {:.2} x raw; {:.2} x the raw rate \
         measured next to it ({consumer_raw:.0}/s) (goal >= 0.8)",
        consumer / raw,
        consumer / consumer_raw
    );
    println!(
        "append -> effect:  p50 {:.2?}, p99 {:.2?}, max {:.2?} over {} events",
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0),
        latencies.last().copied().unwrap_or_default(),
        latencies.len()
    );
    println!("load average at the end: {}", load.trim());
}

fn main() {
    let _ = metrics::set_global_recorder(HookRecorder);
    let rt = runtime();
    let fx = Arc::new(rt.block_on(Fixture::new()));
    let mut c = Criterion::default().configure_from_args();
    bench_raw(&mut c, &rt, &fx, "raw_insert_commit", &RAW_FIRST);
    bench_relay(&mut c, &rt, &fx);
    bench_consumer(&mut c, &rt, &fx);
    bench_latency(&mut c, &rt, &fx);
    bench_raw(&mut c, &rt, &fx, "raw_insert_commit_again", &RAW_LAST);
    c.final_summary();
    summary();
}
