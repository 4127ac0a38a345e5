//! The history's view of the process's metrics: a [`metrics::Recorder`]
//! wrapped around the exporter's, which hands every metric the history
//! reads a second, in-process copy and passes everything else through
//! untouched.
//!
//! Reading the exporter's own output instead would mean parsing its text,
//! and the Prometheus exporter keeps histograms as cumulative buckets,
//! from which an interval's percentiles cannot be taken.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use metrics_util::registry::{AtomicStorage, Registry};
use metrics_util::storage::AtomicBucket;

/// The metrics the history reads; every other metric is not copied.
pub(crate) const TRACKED: &[&str] = &[
    "keel_consumer_handler_seconds",
    "keel_consumer_lag",
    "keel_consumer_in_flight",
    "keel_consumer_retries_total",
    "keel_consumer_dead_lettered_total",
    "keel_client_call_duration_seconds",
    "keel_breaker_rejected_total",
    "keel_breaker_state",
    "keel_breaker_transitions_total",
    "keel_outbox_unpublished",
    "keel_outbox_lag_seconds",
    "keel_outbox_published_total",
    "keel_order_critical_seconds",
];

/// The in-process copies, shared by the recorder and the sampler.
pub(crate) type Copies = Arc<Registry<Key, AtomicStorage>>;

/// A recorder that passes every metric to `inner` (the exporter) and
/// keeps a copy of those the [`History`](super::History) reads. Install it
/// as the global recorder in place of `inner`:
///
/// ```
/// use keel_admin::history::History;
///
/// let history = History::builder().build();
/// let recorder = history.recorder(metrics::NoopRecorder);
/// // metrics::set_global_recorder(recorder) in the process's main.
/// # let _ = recorder;
/// ```
#[derive(Debug)]
pub struct HistoryRecorder<R> {
    inner: R,
    copies: Copies,
}

impl<R> HistoryRecorder<R> {
    pub(crate) fn new(inner: R, copies: Copies) -> Self {
        Self { inner, copies }
    }
}

fn tracked(key: &Key) -> bool {
    TRACKED.contains(&key.name())
}

impl<R: Recorder> Recorder for HistoryRecorder<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        let inner = self.inner.register_counter(key, metadata);
        if !tracked(key) {
            return inner;
        }
        let copy = self.copies.get_or_create_counter(key, Arc::clone);
        Counter::from_arc(Arc::new(Tee { inner, copy }))
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        let inner = self.inner.register_gauge(key, metadata);
        if !tracked(key) {
            return inner;
        }
        let copy = self.copies.get_or_create_gauge(key, Arc::clone);
        Gauge::from_arc(Arc::new(Tee { inner, copy }))
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        let inner = self.inner.register_histogram(key, metadata);
        if !tracked(key) {
            return inner;
        }
        let copy = self.copies.get_or_create_histogram(key, Arc::clone);
        Histogram::from_arc(Arc::new(Tee { inner, copy }))
    }
}

/// A handle writing to the exporter's metric and to the history's copy.
struct Tee<H, C> {
    inner: H,
    copy: Arc<C>,
}

impl CounterFn for Tee<Counter, AtomicU64> {
    fn increment(&self, value: u64) {
        self.inner.increment(value);
        self.copy.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.inner.absolute(value);
        self.copy.fetch_max(value, Ordering::Relaxed);
    }
}

impl GaugeFn for Tee<Gauge, AtomicU64> {
    fn increment(&self, value: f64) {
        self.inner.increment(value);
        GaugeFn::increment(&*self.copy, value);
    }

    fn decrement(&self, value: f64) {
        self.inner.decrement(value);
        GaugeFn::decrement(&*self.copy, value);
    }

    fn set(&self, value: f64) {
        self.inner.set(value);
        GaugeFn::set(&*self.copy, value);
    }
}

impl HistogramFn for Tee<Histogram, AtomicBucket<f64>> {
    fn record(&self, value: f64) {
        self.inner.record(value);
        self.copy.push(value);
    }
}

/// A gauge's value from its copy (gauges are stored as `f64` bits).
pub(crate) fn gauge_value(copy: &AtomicU64) -> f64 {
    f64::from_bits(copy.load(Ordering::Relaxed))
}
