//! What the backends' messaging benchmarks share: the event they move, the
//! tally behind their summaries, and the shape of a timed benchmark.
//!
//! Each backend's bench measures its own store beside the raw rate of the
//! same database in the same run; only the store and the raw statement
//! differ, so the rest lives here once.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput};
use keel_store::envelope::{Envelope, Event, EventMeta};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;

/// Distinct partition keys: enough that per-key order never starves a
/// consumer's 16 slots.
pub const KEYS: u64 = 256;

/// The event the benchmarks append, publish and consume.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderPlaced {
    /// One of [`KEYS`] orders, so events share partition keys.
    pub order_id: String,
    /// The order's total, in minor units.
    pub total_minor: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

/// The `n`th event: order `n % KEYS`, with `n` as its id seed.
pub fn order(n: u64) -> Envelope {
    let placed = OrderPlaced {
        order_id: format!("order-{}", n % KEYS),
        total_minor: i64::try_from(n).unwrap_or(0),
    };
    Envelope::from_event("/services/orders", &placed, EventMeta::new(n)).expect("envelope")
}

/// Elements and time summed over every timed call of one benchmark
/// (warm-up included), for the rates in a summary.
#[derive(Debug, Default)]
pub struct Tally {
    elements: AtomicU64,
    nanos: AtomicU64,
}

impl Tally {
    /// Counts `elements` done in `took`.
    pub fn add(&self, elements: u64, took: Duration) {
        self.elements.fetch_add(elements, Ordering::Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Elements per second over everything counted; 0 before anything was.
    pub fn per_second(&self) -> f64 {
        Self::per_second_of(&[self])
    }

    /// Elements per second over everything the tallies counted together.
    pub fn per_second_of(tallies: &[&Tally]) -> f64 {
        let sum = |field: fn(&Tally) -> &AtomicU64| -> u64 {
            tallies
                .iter()
                .map(|t| field(t).load(Ordering::Relaxed))
                .sum()
        };
        let nanos = sum(|t| &t.nanos);
        if nanos == 0 {
            return 0.0;
        }
        sum(|t| &t.elements) as f64 * 1e9 / nanos as f64
    }
}

/// Runs one benchmark whose routine times itself: `run(iters)` does `iters`
/// elements and returns how long the part that counts took. Ten flat
/// samples, one element each, as slow I/O benchmarks want.
pub fn timed<F, Fut>(c: &mut Criterion, rt: &Runtime, group: &str, name: &str, run: F)
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Duration>,
{
    let mut group = c.benchmark_group(group);
    group.throughput(Throughput::Elements(1));
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.bench_function(name, |b| b.to_async(rt).iter_custom(&run));
    group.finish();
}

/// This process's CPU time and context switches, read from `/proc`: the
/// figures the benchmarks report per unit of work next to the rate, since
/// they vary less than rates between runs on a shared machine.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessUsage {
    /// User and system CPU time.
    pub cpu: Duration,
    /// Voluntary and involuntary context switches of every thread.
    pub context_switches: u64,
}

impl ProcessUsage {
    /// The usage so far; zero where `/proc` cannot be read.
    pub fn now() -> Self {
        Self {
            cpu: process_cpu(),
            context_switches: context_switches(),
        }
    }
}

/// utime + stime of `/proc/self/stat`, at the kernel's usual 100 ticks/s.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command may hold spaces: the fields start after its closing ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of stat, 11 and 12 after ')'.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The context switches of every thread of this process, summed.
fn context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|line| line.contains("ctxt_switches:"))
                .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// [`ProcessUsage`] summed over the timed windows of one benchmark, so that
/// the figure per unit leaves out what criterion does between samples (its
/// analysis alone can be most of a run's CPU).
#[derive(Debug, Default)]
pub struct UsageTally {
    cpu_nanos: AtomicU64,
    switches: AtomicU64,
    units: AtomicU64,
}

impl UsageTally {
    /// Counts what the process used since `before`, for `units` of work.
    pub fn add_since(&self, before: ProcessUsage, units: u64) {
        let now = ProcessUsage::now();
        let cpu = now.cpu.saturating_sub(before.cpu).as_nanos();
        self.cpu_nanos
            .fetch_add(u64::try_from(cpu).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.switches.fetch_add(
            now.context_switches.saturating_sub(before.context_switches),
            Ordering::Relaxed,
        );
        self.units.fetch_add(units, Ordering::Relaxed);
    }

    /// CPU time and context switches per unit, and the units counted.
    pub fn per_unit(&self) -> (Duration, f64, u64) {
        let units = self.units.load(Ordering::Relaxed);
        let per = units.max(1);
        (
            Duration::from_nanos(self.cpu_nanos.load(Ordering::Relaxed) / per),
            self.switches.load(Ordering::Relaxed) as f64 / per as f64,
            units,
        )
    }
}

/// The body of a broker benchmark's message: 256 bytes.
pub const BROKER_PAYLOAD: &[u8] = &[b'x'; 256];

/// A number no other call in this process returned: ids and keys for the
/// broker benchmarks' messages, Keel's and the raw clients' alike.
pub fn next_unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `count` messages of [`BROKER_PAYLOAD`] to `topic`, each with an id
/// (`m-<n>`) and a key (`k-<n>`) of its own, so per-key order never holds
/// one back: what the brokers' publish and consume benchmarks send.
pub fn unique_messages(topic: &str, count: usize) -> Vec<keel_store::broker::Message> {
    (0..count)
        .map(|_| {
            let n = next_unique();
            keel_store::broker::Message::new(
                format!("m-{n}"),
                topic,
                format!("k-{n}"),
                bytes::Bytes::from_static(BROKER_PAYLOAD),
            )
        })
        .collect()
}

/// Receives `count` deliveries from `subscription` and acks each, the acks
/// of a batch sent together: the consume side of the brokers' benchmarks.
pub async fn receive_and_ack(
    subscription: &mut dyn keel_store::broker::Subscription,
    count: usize,
) {
    let mut got = 0;
    while got < count {
        let batch = subscription
            .receive(count - got, Duration::from_secs(5))
            .await
            .expect("receive");
        assert!(!batch.is_empty(), "consume stalled: nothing within 5 s");
        got += batch.len();
        for outcome in futures_util::future::join_all(batch.iter().map(|d| d.ack())).await {
            outcome.expect("ack");
        }
    }
}

/// This process's CPU time and context switches in each of a broker
/// benchmark's four timed windows: publishing and consuming, through Keel
/// and through the raw client beside it.
#[derive(Debug, Default)]
pub struct BrokerUsage {
    /// Publishing through Keel.
    pub publish_keel: UsageTally,
    /// Publishing through the raw client.
    pub publish_raw: UsageTally,
    /// Consuming through Keel.
    pub consume_keel: UsageTally,
    /// Consuming through the raw client.
    pub consume_raw: UsageTally,
}

impl BrokerUsage {
    /// Prints the figures per message under `broker`'s name.
    pub fn report(&self, broker: &str) {
        println!("\n== {broker}: this process's CPU and context switches, timed windows only ==");
        for (name, tally) in [
            ("publish/keel", &self.publish_keel),
            ("publish/raw", &self.publish_raw),
            ("consume/keel", &self.consume_keel),
            ("consume/raw", &self.consume_raw),
        ] {
            let (cpu, switches, messages) = tally.per_unit();
            println!(
                "{name}: {:.1} us of CPU and {switches:.2} context switches per message \
                 ({messages} messages)",
                cpu.as_secs_f64() * 1e6
            );
        }
    }
}

/// Times `iters` runs of `work` (one batch of `batch` messages each), after
/// `prepare` (not timed), counting the process's usage in the timed part
/// into `tally`: a criterion `iter_custom` body for the broker benchmarks.
pub async fn timed_batches<P, W>(
    iters: u64,
    batch: usize,
    tally: &UsageTally,
    mut prepare: impl FnMut() -> P,
    mut work: impl FnMut() -> W,
) -> Duration
where
    P: Future<Output = ()>,
    W: Future<Output = ()>,
{
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        prepare().await;
        let before = ProcessUsage::now();
        let started = keel_core::clock::now();
        work().await;
        total += started.elapsed();
        tally.add_since(before, batch as u64);
    }
    total
}
