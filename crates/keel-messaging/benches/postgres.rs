//! The PostgreSQL store measured against what the server allows: its raw
//! insert-and-commit rate, taken in the same run on the same pool.
//!
//! - `raw_insert_commit`: one 256-byte row per transaction (`BEGIN`,
//!   `INSERT`, `COMMIT` through the store's pool), measured first and again
//!   last, plus 100 raw inserts timed right before every relay sample;
//! - `relay_drain`: N events pre-appended to the outbox (untimed, 500 per
//!   transaction), the relay drains them (claim with `FOR UPDATE SKIP
//!   LOCKED` under the advisory claim lock, publish to a no-op broker, mark
//!   published), batches of 100 as by default; goal at least 0.9 of raw;
//! - append → publish latency at 1,000 events/s: another pool (another
//!   process, as the server sees it) appends and commits one event per
//!   millisecond while a relay whose poll interval is 60 s is woken only by
//!   `PgWakeups` (LISTEN/NOTIFY); the time from each commit's return to the
//!   broker receiving the event, in an HDR histogram;
//! - the same with the relay on PostgreSQL's WAL (`WalOutbox`: a logical
//!   replication slot, the relay woken by the stream), alternating with the
//!   LISTEN/NOTIFY relay twice; each run also reports the CPU time of every
//!   PostgreSQL process per event (from `/proc`, appends included);
//! - append → effect latency at 1,000 events/s, end to end on a scale-out
//!   pair: the same appends, the relay publishing to NATS JetStream
//!   (`NatsBroker`, when `KEEL_TEST_NATS_URL` is set), then to RabbitMQ
//!   (`RabbitBroker`, when `KEEL_TEST_RABBITMQ_URL` is set) and then to Kafka
//!   (`KafkaBroker`, when `KEEL_TEST_KAFKA_URL` is set), and a consumer group
//!   applying each event through the inbox in a PostgreSQL transaction; the
//!   time from each append's commit to its handler running; goal p99 <= 10 ms.
//!   `KEEL_BENCH_EFFECT_RUNS=N` repeats it N times back to back. Events not
//!   arrived 30 s after the last append fail the run, after saying where
//!   they are (keys, unpublished rows, the group's backlog) and whether they
//!   arrive within two more minutes. Warnings are logged to stderr
//!   (`RUST_LOG` to change).
//!
//! For the first three the broker is a no-op so that they measure PostgreSQL alone (the
//! SQLite benchmark publishes to the SQLite broker because that *is* its
//! embedded backend; here the broker is NATS or anything else, measured by
//! its own crate).
//!
//! Needs `KEEL_TEST_POSTGRES_URL`; run through scripts/services.sh:
//!
//! ```text
//! scripts/services.sh run cargo bench -p keel-messaging --bench postgres -- \
//!     --warm-up-time 1 --measurement-time 3
//! ```
//!
//! The figures in BENCHMARKS.md were taken with `KEEL_TEST_PG_FSYNC=off`
//! (scripts/services.sh starts the test server with `fsync=on` unless told),
//! so raw commits cost no disk flush: the ratio compares CPU and round
//! trips. The summary names the setting the run had.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use criterion::Criterion;
use hdrhistogram::Histogram;
use keel_core::clock::{self, Instant};
use keel_kafka::{KafkaBroker, KafkaBrokerOptions};
use keel_messaging::broker::{Broker, BrokerError, Message, SubscribeOptions, Subscription};
use keel_messaging::consumer::{Consumer, Group};
use keel_messaging::envelope::Envelope;
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::Store;
use keel_nats::NatsBrokerOptions;
use keel_postgres::{PgStore, PgWakeups, WalOutbox, WalRelayOptions};
use keel_rabbitmq::{RabbitBroker, RabbitBrokerOptions};
use keel_testkit::bench::{self, OrderPlaced, Tally, order};
use parking_lot::Mutex;
use tokio::runtime::Runtime;

/// The body of a raw row: about the size of an encoded order event.
const ROW_BYTES: usize = 256;
/// Raw inserts timed next to each relay sample.
const ADJACENT_RAW: u64 = 100;
/// Events in the latency run (at 1 kHz: three seconds).
const LATENCY_EVENTS: u64 = 3_000;

// ---------------------------------------------------------------- tally --

static RAW_FIRST: LazyLock<Tally> = LazyLock::new(Tally::default);
static RAW_LAST: LazyLock<Tally> = LazyLock::new(Tally::default);
static RELAY: LazyLock<Tally> = LazyLock::new(Tally::default);
static RELAY_RAW: LazyLock<Tally> = LazyLock::new(Tally::default);

// --------------------------------------------------------------- broker --

/// Accepts everything; remembers when each event id arrived when asked to.
#[derive(Default)]
struct NoopBroker {
    arrivals: Mutex<Option<HashMap<String, Instant>>>,
}

#[async_trait]
impl Broker for NoopBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        if let Some(arrivals) = self.arrivals.lock().as_mut() {
            let now = clock::now();
            for m in messages {
                arrivals.insert(m.id.clone(), now);
            }
        }
        Ok(())
    }

    async fn subscribe(&self, _: SubscribeOptions) -> Result<Box<dyn Subscription>, BrokerError> {
        Err(BrokerError::Unavailable(
            "the benchmark broker has no subscribers".into(),
        ))
    }
}

// -------------------------------------------------------------- fixture --

struct Fixture {
    url: String,
    store: PgStore,
    outbox: Outbox<PgStore>,
    body: Vec<u8>,
    next_event: AtomicU64,
}

impl Fixture {
    async fn new(url: String) -> Self {
        let schema = format!("keel_bench_{}", uuid::Uuid::now_v7().simple());
        let store = PgStore::options()
            .schema(schema)
            .open(url.as_str())
            .await
            .expect("store");
        sqlx::query("CREATE TABLE raw (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body BYTEA NOT NULL)")
            .execute(store.pool())
            .await
            .expect("raw table");
        Self {
            url,
            outbox: Outbox::new(store.clone()),
            store,
            body: vec![b'x'; ROW_BYTES],
            next_event: AtomicU64::new(0),
        }
    }

    /// `n` business transactions of one row each: the yardstick.
    async fn raw_inserts(&self, n: u64) -> Duration {
        let started = clock::now();
        for _ in 0..n {
            let mut tx = self.store.begin().await.expect("begin");
            sqlx::query("INSERT INTO raw (body) VALUES ($1)")
                .bind(self.body.as_slice())
                .execute(&mut *tx)
                .await
                .expect("insert");
            self.store.commit(tx).await.expect("commit");
        }
        started.elapsed()
    }

    /// Appends `n` events, 500 per transaction (untimed setup).
    async fn fill_outbox(&self, n: u64) {
        let first = self.next_event.fetch_add(n, Ordering::Relaxed);
        let events: Vec<Envelope> = (first..first + n).map(order).collect();
        for chunk in events.chunks(500) {
            let mut tx = self.store.begin().await.expect("begin");
            self.outbox
                .append_all(&mut tx, "bench.relay", chunk)
                .await
                .expect("append");
            self.store.commit(tx).await.expect("commit");
        }
    }

    async fn drop_schema(&self) {
        let sql = format!("DROP SCHEMA {} CASCADE", self.store.schema());
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .execute(self.store.pool())
            .await;
    }
}

// ----------------------------------------------------------- benchmarks --

fn bench_raw(
    c: &mut Criterion,
    rt: &Runtime,
    fx: &Arc<Fixture>,
    name: &str,
    tally: &'static Tally,
) {
    bench::timed(c, rt, "postgres", name, |iters| {
        let fx = Arc::clone(fx);
        async move {
            let took = fx.raw_inserts(iters).await;
            tally.add(iters, took);
            took
        }
    });
}

fn bench_relay(c: &mut Criterion, rt: &Runtime, fx: &Arc<Fixture>) {
    bench::timed(c, rt, "postgres", "relay_drain", |iters| {
        let fx = Arc::clone(fx);
        async move {
            fx.fill_outbox(iters).await;
            RELAY_RAW.add(ADJACENT_RAW, fx.raw_inserts(ADJACENT_RAW).await);
            // Defaults: batches of 100.
            let relay = OutboxRelay::builder(&fx.outbox, Arc::new(NoopBroker::default()))
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

/// One append → publish run: the latencies, and the CPU every PostgreSQL
/// process spent per event meanwhile (appends included, the same for
/// every relay).
struct LatencyRun {
    latency: Histogram<u64>,
    pg_cpu_per_event: Duration,
}

/// Appends at 1 kHz from another pool while a relay woken by LISTEN/NOTIFY
/// publishes; returns the commit → publish latencies in microseconds.
async fn latency_run(fx: &Fixture) -> LatencyRun {
    let broker = Arc::new(NoopBroker::default());
    *broker.arrivals.lock() = Some(HashMap::new());
    let (relay, wakeups) = spawn_relay(fx, Arc::clone(&broker) as Arc<dyn Broker>).await;
    let run = measure(fx, "bench.latency", &broker).await;
    relay.stop().await;
    drop(wakeups);
    run
}

/// Appends at 1 kHz and waits for every event to reach `broker`; the
/// latencies and PostgreSQL's CPU per event meanwhile.
async fn measure(fx: &Fixture, topic: &str, broker: &NoopBroker) -> LatencyRun {
    let cpu = PgCpu::now();
    let committed = append_at_1khz(fx, topic).await;
    wait_for(topic, committed.len(), || {
        broker.arrivals.lock().as_ref().map_or(0, HashMap::len)
    })
    .await;
    let pg_cpu_per_event = cpu.since() / LATENCY_EVENTS as u32;
    let arrivals = broker.arrivals.lock().take().unwrap_or_default();
    LatencyRun {
        latency: histogram(&committed, &arrivals),
        pg_cpu_per_event,
    }
}

/// The same appends while a relay fed by a replication slot (`WalOutbox`,
/// woken by the stream, poll interval 60 s, sweep every 10 s) publishes.
async fn wal_latency_run(fx: &Fixture) -> LatencyRun {
    let broker = Arc::new(NoopBroker::default());
    *broker.arrivals.lock() = Some(HashMap::new());
    let options = WalRelayOptions::default().named(fx.store.schema());
    let wal = WalOutbox::start(fx.store.clone(), &fx.url, options)
        .await
        .expect("WAL relay (wal_level = logical?)");
    let outbox = Outbox::new(wal.clone());
    wal.wake_with(outbox.waker());
    let relay = OutboxRelay::builder(&outbox, Arc::clone(&broker) as Arc<dyn Broker>)
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay");
    let relay = Running::spawn(|stopped| async move { relay.run(stopped).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let run = measure(fx, "bench.wal", &broker).await;
    relay.stop().await;
    wal.decommission().await.expect("drop the slot");
    run
}

/// CPU time of every process named `postgres` on this machine (the test
/// server's backends, walsenders and background workers), from `/proc`.
struct PgCpu(Duration);

impl PgCpu {
    fn now() -> Self {
        Self(postgres_cpu())
    }

    fn since(&self) -> Duration {
        postgres_cpu().saturating_sub(self.0)
    }
}

fn postgres_cpu() -> Duration {
    let ticks_per_second = 100; // USER_HZ on Linux
    let mut ticks = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((name, rest)) = stat.split_once(") ") else {
            continue;
        };
        if !name.ends_with("(postgres") {
            continue;
        }
        // After the name: state, then fields 4.., utime and stime are 14 and 15.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| {
            fields
                .get(n - 3)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        ticks += field(14) + field(15);
    }
    Duration::from_millis(ticks * 1000 / ticks_per_second)
}

/// The brokers the append -> effect run goes through: NATS JetStream,
/// RabbitMQ and Kafka, each when the test command's URL for it is set.
async fn effect_brokers() -> Vec<(&'static str, Arc<dyn Broker>)> {
    let prefix = format!("bench_{}", &uuid::Uuid::now_v7().simple().to_string()[20..]);
    let mut brokers: Vec<(&'static str, Arc<dyn Broker>)> = Vec::new();
    if let Ok(url) = std::env::var(keel_testkit::services::NATS_URL) {
        let nats = NatsBrokerOptions::new()
            .stream_prefix(&prefix)
            .open(&url)
            .await
            .expect("connect to NATS");
        brokers.push(("NATS JetStream", Arc::new(nats)));
    }
    if let Ok(url) = std::env::var(keel_testkit::services::RABBITMQ_URL) {
        let rabbit = RabbitBroker::connect(RabbitBrokerOptions::new(&url).prefix(&prefix))
            .await
            .expect("connect to RabbitMQ");
        brokers.push(("RabbitMQ", Arc::new(rabbit)));
    }
    if let Ok(url) = std::env::var(keel_testkit::services::KAFKA_URL) {
        // tansu answers a fetch only after its wait, records or not (Kafka
        // answers as they arrive): the wait is the latency's floor there.
        let options = KafkaBrokerOptions::from_url(&url)
            .expect("a kafka:// URL")
            .prefix(&prefix)
            .fetch_wait(Duration::from_millis(5))
            .delete_topics(false);
        let kafka = KafkaBroker::connect(options)
            .await
            .expect("connect to Kafka");
        brokers.push(("Kafka", Arc::new(kafka)));
    }
    brokers
}

/// The same appends, end to end on a scale-out pair: the relay publishes
/// to `broker` and a consumer group applies each event through the inbox in
/// a PostgreSQL transaction. Returns the time from each append's commit to
/// its handler running inside the effect's transaction (the effect's own
/// commit follows).
async fn effect_latency_run(fx: &Fixture, broker: Arc<dyn Broker>) -> Histogram<u64> {
    let effects: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen = Arc::clone(&effects);
    let group = Group::new("bench.effect", "bench").on_event(
        move |_tx: &mut <PgStore as Store>::Tx, _: OrderPlaced, env: &Envelope| {
            seen.lock().insert(env.id.clone(), clock::now());
            Box::pin(async { Ok(()) })
        },
    );
    let consumer = Consumer::builder(fx.store.clone(), Arc::clone(&broker))
        .group(group)
        .build()
        .expect("consumer");
    // A queue broker keeps only what arrives once a group exists.
    consumer.declare_groups().await.expect("declare the group");
    let consumer = Running::spawn(|stopped| async move {
        consumer.run(stopped).await;
    });
    let (relay, wakeups) = spawn_relay(fx, Arc::clone(&broker)).await;
    let committed = append_at_1khz(fx, "bench.effect").await;
    if !arrive_in_time(committed.len(), || effects.lock().len()).await {
        let missing: Vec<usize> = {
            let effects = effects.lock();
            (0..committed.len())
                .filter(|i| !effects.contains_key(&committed[*i].0))
                .collect()
        };
        diagnose_stall(fx, broker.as_ref(), &missing).await;
        let late = clock::now();
        let all = arrive_within(Duration::from_secs(120), committed.len(), || {
            effects.lock().len()
        })
        .await;
        panic!(
            "append -> effect: {} of {} events had not arrived 30 s after the last append; {}",
            missing.len(),
            committed.len(),
            if all {
                format!("all arrived {:.1} s later", late.elapsed().as_secs_f64())
            } else {
                "some had not arrived 120 s later".to_owned()
            }
        );
    }
    let arrivals = std::mem::take(&mut *effects.lock());
    relay.stop().await;
    consumer.stop().await;
    drop(wakeups);
    histogram(&committed, &arrivals)
}

/// A spawned relay or consumer, stopped between rounds. Aborting one could
/// leave its last round's rows claimed for a whole lease, and those rows'
/// keys are the next run's keys: the next relay then held every later row of
/// them back until the lease ran out and its 60 s poll came round (the
/// "first run" stalls of earlier series).
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn spawn<F, Fut>(run: F) -> Self
    where
        F: FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = Box::pin(async move {
            let _ = stopped.await;
        });
        Self {
            stop,
            task: tokio::spawn(run(stopped)),
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// A relay on `broker` whose poll interval is 60 s, woken only by
/// `PgWakeups`, running once it listens.
async fn spawn_relay(fx: &Fixture, broker: Arc<dyn Broker>) -> (Running, PgWakeups) {
    let outbox = Outbox::new(fx.store.clone());
    let relay = OutboxRelay::builder(&outbox, broker)
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay");
    let waker = outbox.clone();
    let wakeups = PgWakeups::builder(&fx.store)
        .on_outbox(move || waker.notify())
        .spawn();
    wakeups.listening().await;
    let relay = Running::spawn(|stopped| async move { relay.run(stopped).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    (relay, wakeups)
}

/// From its own pool (another process, as the server sees it), appends and
/// commits one event to `topic` per millisecond; returns each event id with
/// the time its commit returned.
async fn append_at_1khz(fx: &Fixture, topic: &str) -> Vec<(String, Instant)> {
    let producer = PgStore::options()
        .schema(fx.store.schema())
        .open(fx.url.as_str())
        .await
        .expect("producer store");
    let producer_outbox = Outbox::new(producer.clone());
    let first = fx.next_event.fetch_add(LATENCY_EVENTS, Ordering::Relaxed);
    let mut committed = Vec::with_capacity(usize::try_from(LATENCY_EVENTS).unwrap_or(0));
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    for n in first..first + LATENCY_EVENTS {
        tick.tick().await;
        let envelope = order(n);
        let mut tx = producer.begin().await.expect("begin");
        producer_outbox
            .append(&mut tx, topic, &envelope)
            .await
            .expect("append");
        // Store::commit, not Outbox::commit: no in-process wake-up.
        producer.commit(tx).await.expect("commit");
        committed.push((envelope.id, clock::now()));
    }
    committed
}

/// Waits (up to 30 s) until `arrived` counts all `committed` events. It
/// only counts: copying the arrivals every few milliseconds would take CPU
/// from the events still in flight.
async fn wait_for(stage: &str, committed: usize, arrived: impl Fn() -> usize) {
    assert!(
        arrive_in_time(committed, &arrived).await,
        "{stage}: {} of {committed} events arrived within 30 s",
        arrived()
    );
}

async fn arrive_in_time(committed: usize, arrived: impl Fn() -> usize) -> bool {
    arrive_within(Duration::from_secs(30), committed, arrived).await
}

async fn arrive_within(wait: Duration, committed: usize, arrived: impl Fn() -> usize) -> bool {
    let deadline = clock::now() + wait;
    while arrived() < committed {
        if clock::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// Says where the events that did not arrive are: their partition keys,
/// how many rows the relay has not published, and the consumer group's
/// backlog as JetStream counts it.
async fn diagnose_stall(fx: &Fixture, broker: &dyn Broker, missing: &[usize]) {
    let first = fx.next_event.load(Ordering::Relaxed) - LATENCY_EVENTS;
    let mut keys: Vec<u64> = missing
        .iter()
        .map(|i| (first + *i as u64) % bench::KEYS)
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let unpublished: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM keel_outbox WHERE topic = 'bench.effect' AND published_at IS NULL",
    )
    .fetch_one(fx.store.pool())
    .await
    .unwrap_or(-1);
    // The first unpublished rows of those keys in any topic, with their
    // claims: whether a relay took them, or an earlier row of the key (an
    // earlier run's) holds them back.
    let key_names: Vec<String> = keys.iter().map(|k| format!("order-{k}")).collect();
    let claims: Vec<String> = sqlx::query_scalar(
        "SELECT 'id ' || id || ', topic ' || topic || ', key ' || partition_key \
                || ', claimed by ' || COALESCE(claimed_by::text, '-') || ' until ' \
                || COALESCE(claimed_until::text, '-') || ', attempts ' || attempts \
                || ', created ' || created_at || ', now ' || now() \
           FROM keel_outbox WHERE published_at IS NULL AND partition_key = ANY($1) \
          ORDER BY id LIMIT 4",
    )
    .bind(&key_names)
    .fetch_all(fx.store.pool())
    .await
    .unwrap_or_else(|e| vec![format!("could not read the claims: {e}")]);
    let backlog = broker.backlog("bench.effect", "bench").await;
    eprintln!(
        "append -> effect stalled: {} events missing (event offsets {:?}), keys {:?}; \
         {unpublished} outbox rows unpublished (first: {claims:?}); consumer group backlog \
         {backlog:?}",
        missing.len(),
        &missing[..missing.len().min(20)],
        keys
    );
}

/// Commit → arrival latencies in microseconds.
fn histogram(
    committed: &[(String, Instant)],
    arrivals: &HashMap<String, Instant>,
) -> Histogram<u64> {
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
    for (id, at) in committed {
        let arrived = arrivals.get(id).copied().unwrap_or(*at);
        let micros = arrived.saturating_duration_since(*at).as_micros();
        histogram
            .record(u64::try_from(micros).unwrap_or(u64::MAX).max(1))
            .expect("record");
    }
    histogram
}

// -------------------------------------------------------------- summary --

/// `KEEL_BENCH_EFFECT_RUNS` (default 1): how many append -> effect runs,
/// back to back, for the goal's "five consecutive runs".
fn effect_runs() -> usize {
    std::env::var("KEEL_BENCH_EFFECT_RUNS")
        .ok()
        .and_then(|runs| runs.parse().ok())
        .unwrap_or(1)
}

fn summary(runs: &[(&str, &LatencyRun)], effects: &[(&str, Histogram<u64>)]) {
    let (first, last) = (RAW_FIRST.per_second(), RAW_LAST.per_second());
    let raw = Tally::per_second_of(&[&RAW_FIRST, &RAW_LAST]);
    let (relay, relay_raw) = (RELAY.per_second(), RELAY_RAW.per_second());
    let ms = |micros: u64| micros as f64 / 1000.0;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!();
    let fsync = std::env::var("KEEL_TEST_PG_FSYNC").unwrap_or_else(|_| "on".to_owned());
    println!("== postgres summary (test server: fsync={fsync}, synchronous_commit=on) ==");
    println!("raw insert+commit: {raw:.0} rows/s (first {first:.0}, last {last:.0})");
    println!(
        "relay drain:       {relay:.0} events/s = {:.2} x raw; {:.2} x the raw rate \
         measured next to it ({relay_raw:.0}/s) (goal >= 0.9)",
        relay / raw,
        relay / relay_raw
    );
    for (relay, run) in runs {
        let latency = &run.latency;
        println!(
            "append -> publish at 1,000 events/s ({relay}): p50 {:.2} ms, p99 {:.2} ms, \
             p99.9 {:.2} ms, max {:.2} ms over {} events (goal p99 <= 10 ms); PostgreSQL CPU \
             {:.0} us per event (appends included)",
            ms(latency.value_at_quantile(0.50)),
            ms(latency.value_at_quantile(0.99)),
            ms(latency.value_at_quantile(0.999)),
            ms(latency.max()),
            latency.len(),
            run.pg_cpu_per_event.as_secs_f64() * 1e6,
        );
    }
    for (broker, effect) in effects {
        println!(
            "append -> effect at 1,000 events/s (relay -> {broker} -> consumer, inbox on \
             PostgreSQL): p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms over {} events \
             (goal p99 <= 10 ms)",
            ms(effect.value_at_quantile(0.50)),
            ms(effect.value_at_quantile(0.99)),
            ms(effect.value_at_quantile(0.999)),
            ms(effect.max()),
            effect.len()
        );
    }
    if effects.is_empty() {
        println!(
            "append -> effect: skipped (none of {}, {} and {} is set)",
            keel_testkit::services::NATS_URL,
            keel_testkit::services::RABBITMQ_URL,
            keel_testkit::services::KAFKA_URL
        );
    }
    println!("load average at the end: {}", load.trim());
}

fn main() {
    let Ok(url) = std::env::var(keel_testkit::services::POSTGRES_URL) else {
        eprintln!(
            "{} is not set: run through scripts/services.sh \
             (scripts/services.sh run cargo bench -p keel-messaging --bench postgres)",
            keel_testkit::services::POSTGRES_URL
        );
        std::process::exit(2);
    };
    // Warnings (a failed settle, a receive backing off) explain a stall.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let fx = Arc::new(rt.block_on(Fixture::new(url)));
    let mut c = Criterion::default().configure_from_args();
    bench_raw(&mut c, &rt, &fx, "raw_insert_commit", &RAW_FIRST);
    bench_relay(&mut c, &rt, &fx);
    // Alternating, twice each: the machine's drift shows as a spread.
    let mut runs = Vec::new();
    for _ in 0..2 {
        runs.push((
            "polling relay, LISTEN/NOTIFY, poll 60 s",
            rt.block_on(latency_run(&fx)),
        ));
        runs.push((
            "WAL relay, woken by the slot's stream",
            rt.block_on(wal_latency_run(&fx)),
        ));
    }
    let mut effects = Vec::new();
    for (name, broker) in rt.block_on(effect_brokers()) {
        for _ in 0..effect_runs() {
            effects.push((
                name,
                rt.block_on(effect_latency_run(&fx, Arc::clone(&broker))),
            ));
        }
    }
    bench_raw(&mut c, &rt, &fx, "raw_insert_commit_again", &RAW_LAST);
    c.final_summary();
    let runs: Vec<(&str, &LatencyRun)> = runs.iter().map(|(name, run)| (*name, run)).collect();
    summary(&runs, &effects);
    rt.block_on(fx.drop_schema());
}
