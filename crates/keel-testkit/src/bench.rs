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
